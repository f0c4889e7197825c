"""MIXED prefill+decode steps: staggered requests produce exactly the tokens each produces alone."""

from __future__ import annotations

import pytest

from encore.engine import Engine, SamplingParams
from workloads import run_staggered

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[7 + i * 3 + j for j in range(5 + 4 * i)] for i in range(6)]
ARRIVAL_STEP = [0, 0, 2, 3, 5, 9]


def staggered(engine: Engine) -> dict[str, list[int]]:
    return {rid: out.token_ids for rid, out in run_staggered(engine, PROMPTS, GREEDY, ARRIVAL_STEP).items()}


@pytest.fixture(scope="module")
def alone(v3_dir):
    """Each prompt generated on its own, one at a time."""
    engine = Engine(str(v3_dir), device="cpu", page_size=4)
    return [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_staggered_mixed_batches_match_solo_runs(v3_dir, alone):
    engine = Engine(str(v3_dir), device="cpu", page_size=4, chunked_prefill_size=6, max_num_batched_tokens=12)
    done = staggered(engine)
    steps = engine.stats()["steps"]
    assert steps["EXTEND"] > 0 and steps["MIXED"] > 0 and steps["DECODE"] > 0, steps
    for i in range(len(PROMPTS)):
        assert done[f"r{i}"] == alone[i], i
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]


def test_mixed_batch_off_runs_no_mixed_steps_and_same_tokens(v3_dir, alone):
    engine = Engine(str(v3_dir), device="cpu", page_size=4, chunked_prefill_size=6, max_num_batched_tokens=12,
                    enable_mixed_batch=False)
    done = staggered(engine)
    steps = engine.stats()["steps"]
    assert steps["MIXED"] == 0 and steps["EXTEND"] > 0 and steps["DECODE"] > 0, steps
    for i in range(len(PROMPTS)):
        assert done[f"r{i}"] == alone[i], i


def test_preemption_by_recompute_keeps_greedy_tokens(v3_dir, alone):
    # 13 usable pages of 4 tokens cannot hold all six requests at once: some get preempted.
    engine = Engine(str(v3_dir), device="cpu", page_size=4, num_kv_pages=14, chunked_prefill_size=6,
                    max_num_batched_tokens=12)
    done = staggered(engine)
    assert engine.stats()["preemptions"] > 0
    for i in range(len(PROMPTS)):
        assert done[f"r{i}"] == alone[i], i
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
