"""Overlapped steps (engine.py): each step is launched before the previous one's tokens are read, and
the requests come out exactly as without overlap — tokens, text, logprobs, finish reasons — whatever
ends them (length, EOS, stop strings and ids, abort, the context), with arrivals between steps,
preemption, the prefix cache, and rows that cannot overlap (grammar, penalties) in the same batch."""

from __future__ import annotations

import random

import pytest
import torch

from encore.engine import Engine, SamplingParams
from encore.engine.request import PENDING

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n", "for i in range(10):\n",
           "Hello", "The quick brown fox jumps over the lazy dog. " * 3]


def engine(overlap: bool, **options) -> Engine:
    return Engine(device="cpu", overlap_schedule=overlap, seed=3, **options)


def run(engine: Engine, arrivals: dict[int, list[tuple[str, str, SamplingParams]]],
        aborts: dict[int, list[str]] | None = None) -> dict[str, tuple]:
    """Steps ``engine`` until it is idle; ``arrivals[i]`` / ``aborts[i]`` happen before the engine launches
    its step i (at once where it is idle before then: a call with overlap may launch no step). Returns
    each request's final output as (token ids, text, finish reason, logprobs), and checks every output
    on the way: no placeholder ever shows, and the deltas add up to the final tokens."""
    aborts = aborts or {}
    due = sorted(set(arrivals) | set(aborts))
    streamed: dict[str, list[int]] = {}
    final: dict[str, tuple] = {}
    while engine.has_unfinished_requests() or due:
        launched = sum(engine.stats()["steps"].values())
        while due and (due[0] <= launched or not engine.has_unfinished_requests()):
            at = due.pop(0)
            for rid, prompt, params in arrivals.get(at, []):
                engine.add_request(rid, prompt, params)
            for rid in aborts.get(at, []):
                engine.abort(rid)
        for out in engine.step():
            assert PENDING not in out.token_ids and PENDING not in out.new_token_ids
            assert len(out.token_ids) == out.num_output_tokens
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert streamed[out.request_id] == out.token_ids
            if out.finished:
                logprobs = [(lp.token_id, lp.logprob, [t for t, _ in lp.top]) for lp in out.logprobs or []]
                final[out.request_id] = (out.token_ids, out.text, out.finish_reason, logprobs)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages  # every page back (free or idle)
    assert not any(engine.kv.pool.refcount)
    return final


def assert_same(got: dict[str, tuple], want: dict[str, tuple], aborted: frozenset[str] = frozenset()) -> None:
    """Same requests, each with the same tokens, text and finish reason, and logprobs of the same tokens
    within 1e-4 (a preempted request recomputes in batches that differ with overlap: float sums move);
    an ``aborted`` request only needs a prefix of the other's tokens."""
    assert set(got) == set(want)
    for rid, (tokens, text, reason, logprobs) in want.items():
        if rid in aborted and "abort" in (reason, got[rid][2]):
            shorter = min(len(tokens), len(got[rid][0]))
            assert got[rid][0][:shorter] == tokens[:shorter], rid
            continue
        assert got[rid][:3] == (tokens, text, reason), rid
        assert [(t, top) for t, _, top in got[rid][3]] == [(t, top) for t, _, top in logprobs], rid
        assert [v for _, v, _ in got[rid][3]] == pytest.approx([v for _, v, _ in logprobs], abs=1e-4), rid


def both(arrivals, aborts=None, same_steps=True, **options) -> tuple[dict, dict, Engine]:
    """Runs ``arrivals`` without and with overlap; unless told otherwise, the steps run are the same
    (a row that ends by length at a token in flight gets no next step)."""
    off, on = engine(False, **options), engine(True, **options)
    results = run(off, arrivals, aborts), run(on, arrivals, aborts)
    if same_steps and not aborts:
        assert on.stats()["steps"] == off.stats()["steps"]
    return *results, on


def test_same_requests_as_without_overlap_with_arrivals_between_steps():
    params = [SamplingParams(max_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=9, temperature=0.8, seed=7),
              SamplingParams(max_tokens=7, temperature=1.0, top_p=0.9, seed=11, logprobs=3),
              SamplingParams(max_tokens=1, temperature=0.0),  # ends at its prefill's token
              SamplingParams(max_tokens=10, temperature=0.0, logprobs=1)]
    arrivals = {0: [(f"a{i}", PROMPTS[i], p) for i, p in enumerate(params[:3])],
                2: [("b0", PROMPTS[3], params[3]), ("b1", PROMPTS[4], params[4])],
                5: [("c0", PROMPTS[5], params[0])]}
    off, on, engine_on = both(arrivals)
    assert_same(on, off)
    assert all(len(tokens) == params[0].max_tokens for tokens, *_ in (off["a0"], off["c0"]))
    stats = engine_on.stats()
    assert stats["overlapped_steps"] == sum(stats["steps"].values())  # every step overlapped


def test_rows_that_end_on_a_token_still_in_flight():
    """A row that ends at a token the next step was launched on (EOS, a stop token, a stop string) is
    dropped from that step; a stop string ending inside the text trims it as without overlap."""
    probe = engine(False).generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=12, temperature=0.0))
    stop_token = probe[0].token_ids[3]
    stop_text = probe[1].text[4:7]
    params = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_token,)),
              SamplingParams(max_tokens=12, temperature=0.0, stop=(stop_text,)),
              SamplingParams(max_tokens=12, temperature=0.0)]
    arrivals = {0: [("stop-id", PROMPTS[0], params[0]), ("stop-str", PROMPTS[2], params[1]),
                    ("length", PROMPTS[3], params[2])]}
    off, on, _ = both(arrivals)
    assert_same(on, off)
    assert off["stop-id"][0][-1] == stop_token and off["stop-id"][2] == "stop"
    assert off["stop-str"][2] == "stop" and stop_text not in off["stop-str"][1]


def test_eos_ends_a_row_in_flight(monkeypatch):
    probe = engine(False).generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0))
    eos = probe[0].token_ids[4]
    arrivals = {0: [("r", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0)),
                    ("s", PROMPTS[4], SamplingParams(max_tokens=12, temperature=0.0))]}
    results = []
    for overlap in (False, True):
        e = engine(overlap)
        e.eos_token_ids = frozenset({eos})
        results.append(run(e, arrivals))
    assert_same(results[1], results[0])
    assert results[0]["r"][0][-1] == eos and len(results[0]["r"][0]) == 5 and results[0]["r"][2] == "stop"


def test_abort_while_its_token_is_in_flight():
    """An abort drops the token still in flight (the client has not seen it): the aborted request
    ends with a prefix of its tokens, the others are untouched, and every page comes back (``run``)."""
    params = SamplingParams(max_tokens=20, temperature=0.0)
    arrivals = {0: [(f"r{i}", PROMPTS[i], params) for i in range(4)]}
    full = run(engine(False), arrivals)
    off, on, _ = both(arrivals, aborts={3: ["r1"], 4: ["r2"]})
    for rid in ("r1", "r2"):
        assert on[rid][2] == off[rid][2] == "abort"
        assert 0 < len(on[rid][0]) <= len(off[rid][0]) < 20
        assert full[rid][0][:len(off[rid][0])] == off[rid][0]
        assert off[rid][0][:len(on[rid][0])] == on[rid][0]
    assert_same(on, off, aborted=frozenset({"r1", "r2"}))


def test_preemption_with_tokens_in_flight():
    """A pool too small for every row: requests are preempted (some with a token still in flight) and
    recomputed, and still come out as without overlap, and as with room for all. (A request preempted
    with a token in flight waits for it, so the steps differ.)"""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", PROMPTS[i], params) for i in range(5)]}
    off, on, engine_on = both(arrivals, same_steps=False, page_size=4, num_kv_pages=24,
                              enable_prefix_caching=False)
    roomy = run(engine(True), arrivals)
    assert_same(on, off)
    assert_same(roomy, off)
    assert engine_on.stats()["preemptions"] > 0


def test_context_end_by_length():
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("r", PROMPTS[0], params), ("s", PROMPTS[4], params)]}
    off, on, _ = both(arrivals, max_model_len=24)
    assert_same(on, off)
    assert off["r"][2] == "length" and len(off["r"][0]) < 100


def test_prefix_cache_hits_the_same():
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    shared = PROMPTS[5]
    arrivals = {0: [("first", shared + "one", params)], 3: [(f"r{i}", shared + q, params) for i, q in
                                                           enumerate(["two", "three", "four"])]}
    off, on, engine_on = both(arrivals, page_size=4)
    assert_same(on, off)
    assert engine_on.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("kind", ["grammar", "penalties", "min_tokens"])
def test_grammar_and_penalty_rows_overlap_too(kind):
    """A grammar's matcher and penalties' counts need the previous token on the host: the step in flight
    is committed once the next forward is launched, before the mask and the counts are built. Rows short
    of their min_tokens (their stop tokens masked, stop strings not matched) go the same way."""
    special = {
        "grammar": SamplingParams(max_tokens=8, temperature=0.0, regex="[a-z]+ [0-9]+"),
        "penalties": SamplingParams(max_tokens=8, temperature=0.7, seed=5, repetition_penalty=1.3,
                                    presence_penalty=0.5),
        "min_tokens": SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6, stop=("e", " "),
                                     stop_token_ids=(274, 291)),
    }[kind]
    plain = SamplingParams(max_tokens=16, temperature=0.0)
    arrivals = {0: [("plain0", PROMPTS[0], plain), ("plain1", PROMPTS[1], plain)],
                3: [("special", PROMPTS[2], special), ("special2", PROMPTS[3], special)]}
    off, on, engine_on = both(arrivals)
    assert_same(on, off)
    stats = engine_on.stats()
    assert stats["overlapped_steps"] == sum(stats["steps"].values())


def test_first_tokens_are_returned_before_the_next_launch_where_their_step_did_not_replay():
    """The outputs of a step that completed prompts without a graph replay (every step on the CPU) are
    returned before the next step is launched; a step of decode rows only stays in flight during the
    next one's launch."""
    e = engine(True)
    e.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))
    req = e.requests["r"]
    returned: list[int] = []
    at_forward = []  # (tokens returned so far, tokens in flight) as each forward is launched
    forward = e.runner.forward

    def spy(batch, token_ids=None):
        at_forward.append((len(returned), req.num_pending))
        return forward(batch, token_ids)

    e.runner.forward = spy
    while e.has_unfinished_requests():
        for out in e.step():
            returned.extend(out.new_token_ids)
    # the prompt step; its first token returned before the first decode step; then each decode step
    # launched while the one before is in flight
    assert at_forward == [(0, 0), (1, 0), (1, 1), (2, 1)]
    assert len(returned) == 4


def random_workload(seed: int, vocab: int) -> tuple[dict, dict]:
    """Arrivals over the first 12 step calls (token-id prompts, some sharing a prefix; greedy, seeded,
    logprobs, stop ids, small max_tokens, a regex, penalties) and a few aborts."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(24)]
    arrivals, aborts, n = {}, {}, 0
    for call in range(12):
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            prompt = (shared[:rng.randrange(25)] if rng.random() < 0.5 else []) + [
                rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            kind = rng.random()
            if kind < 0.35:
                params = SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0)
            elif kind < 0.6:
                params = SamplingParams(max_tokens=rng.randrange(1, 20), temperature=1.0, top_p=0.9,
                                        seed=rng.randrange(100), logprobs=rng.choice([None, 2]))
            elif kind < 0.75:
                params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(rng.randrange(vocab),))
            elif kind < 0.85:
                params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0, regex="[a-z]{1,6} [0-9]+")
            else:
                params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.8, seed=1,
                                        frequency_penalty=0.5)
            arrivals.setdefault(call, []).append((f"r{n}", prompt, params))
            n += 1
        if n and rng.random() < 0.15:
            aborts.setdefault(call + 1, []).append(f"r{rng.randrange(n)}")
    return arrivals, aborts


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_end_as_without_overlap(seed):
    """Random arrivals, parameters and aborts on a small page pool (preemptions, prefix hits): every
    request that was not aborted ends exactly as without overlap, and an aborted one with a prefix of
    what it had there; no page leaks (``run``)."""
    options = dict(page_size=4, num_kv_pages=40, max_num_seqs=6, max_model_len=64)
    vocab = engine(False, **options).model_config.vocab_size
    arrivals, aborts = random_workload(seed, vocab)
    off, on = run(engine(False, **options), arrivals, aborts), run(engine(True, **options), arrivals, aborts)
    assert_same(on, off, aborted=frozenset(rid for rids in aborts.values() for rid in rids))


GPU_KEYS = dict(max_model_len=256, max_num_seqs=16, graph_decode_sizes=(1, 2, 4, 8, 16),
                graph_mixed_decode_sizes=(4, 16), graph_prefill_tokens=(64,), graph_extend_sizes=(1, 4),
                graph_mixed_extends=(1, 4))


def id_prompt(i: int, n: int) -> list[int]:
    return [(31 * i + 7 * j) % 250 + 5 for j in range(n)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend,dtype", [("triton", "float32"), ("triton", "bfloat16"),
                                           ("flashinfer", "bfloat16")])
def test_cuda_graph_steps_overlap_with_the_same_tokens(backend, dtype, tmp_path):
    """On the GPU the next step is launched while the device runs the previous one: its decode rows'
    ids come from the previous step's output on the device (greedy head graphs, the sampler), into the
    padded graph buffers and into steps that no key holds (a 100-token prompt beside decode rows). The
    steps are the same as without overlap, so even bf16 gives the very same tokens."""
    model = None
    if backend == "flashinfer":  # encore-tiny's MLA widths are not among flashinfer's
        pytest.importorskip("flashinfer")
        from checkpoints import write_checkpoint

        model = str(write_checkpoint("v2_lite", tmp_path, overrides=dict(kv_lora_rank=128, qk_nope_head_dim=128,
                                                                         qk_rope_head_dim=64, v_head_dim=128)))
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.9, top_k=50, seed=9, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.0, logprobs=2)]
    arrivals = {0: [(f"a{i}", id_prompt(i, 5 + 3 * i), params[i % 3]) for i in range(3)],
                2: [(f"b{i}", id_prompt(i % 3, 40), params[(i + 1) % 3]) for i in range(6)],
                4: [("c", id_prompt(7, 100), params[0])]}
    results, stats = [], []
    for overlap in (False, True):
        e = Engine(model, device="cuda", dtype=dtype, attention_backend=backend, overlap_schedule=overlap, seed=3,
                   **GPU_KEYS)
        results.append(run(e, arrivals))
        stats.append(e.stats())
    assert results[1] == results[0]
    assert stats[1]["steps"] == stats[0]["steps"]
    assert stats[1]["overlapped_steps"] == sum(stats[1]["steps"].values())
    assert stats[1]["graph_replays"] > 0 and stats[1]["head_graph_replays"] > 0
    assert stats[1]["compiled_steps"] > 0  # the long prompt's step, on no key
    assert stats[1]["eager_steps"] == stats[0]["eager_steps"]
