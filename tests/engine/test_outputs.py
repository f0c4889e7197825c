"""What a step's RequestOutput reports, read after later steps have run, and the wall time the engine
counts inside its steps."""

from __future__ import annotations

import time

from encore.engine import Engine, SamplingParams


def test_each_output_keeps_the_tokens_of_its_own_step(v3_dir):
    """``token_ids`` is read lazily from the request's growing token list: an output kept from an earlier
    step, read once the request has finished, still holds exactly the tokens streamed up to its step."""
    engine = Engine(str(v3_dir), device="cpu")
    engine.add_request("a", [5, 9, 40], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.add_request("b", [7, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    kept = []
    while engine.has_unfinished_requests():
        kept.extend(engine.step())
    streamed: dict[str, list[int]] = {"a": [], "b": []}
    for out in kept:
        streamed[out.request_id] += out.new_token_ids
        assert out.token_ids == streamed[out.request_id], out.request_id
    assert [len(streamed["a"]), len(streamed["b"])] == [6, 4]


def test_stats_count_the_wall_time_inside_steps(v3_dir, monkeypatch):
    """``stats()["step_seconds"]``: each step() call's wall time, and nothing outside the calls."""
    engine = Engine(str(v3_dir), device="cpu")
    engine.add_request("a", [5, 9, 40], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    plan = engine._step
    monkeypatch.setattr(engine, "_step", lambda: (time.sleep(0.02), plan())[1])
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        time.sleep(0.05)  # between the calls: not counted
    wall = time.perf_counter() - start
    assert 0.02 * steps <= engine.stats()["step_seconds"] < wall - 0.05 * steps
