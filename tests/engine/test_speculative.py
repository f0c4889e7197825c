"""Speculative decoding: greedy outputs identical to plain decoding, acceptance really exercised,
stochastic acceptance preserving the target distribution, and no KV page leak."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints import write_mtp_checkpoint
from encore.engine import Engine, SamplingParams
from test_kv_cache import check_invariants
from workloads import run_staggered

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, item):\n",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n"]


@pytest.fixture(scope="module")
def reference():
    """Plain greedy decoding of encore-tiny, alone per prompt, with enough tokens for replay."""
    engine = Engine(device="cpu", page_size=4)
    long = SamplingParams(max_tokens=GREEDY.max_tokens + 8, temperature=0.0, ignore_eos=True)
    return {f"r{i}": engine.generate([p], long)[0].token_ids for i, p in enumerate(PROMPTS)}


WORKLOADS = {
    "decode": dict(arrivals=[0, 0, 0, 0], options=dict()),
    "mixed": dict(arrivals=[0, 1, 3, 4], options=dict(chunked_prefill_size=6, max_num_batched_tokens=16)),
}


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("workload", ["decode", "mixed"])
def test_greedy_speculation_is_token_identical(reference, method, k, workload):
    w = WORKLOADS[workload]
    engine = Engine(device="cpu", page_size=4, speculative={"method": method, "num_speculative_tokens": k},
                    **w["options"])
    done = run_staggered(engine, PROMPTS, GREEDY, w["arrivals"])
    for rid, out in done.items():
        assert out.token_ids == reference[rid][:GREEDY.max_tokens], (rid, method, k, workload)
    stats = engine.stats()
    if workload == "mixed":
        assert stats["steps"]["MIXED"] > 0, stats["steps"]
    assert stats["spec_draft_tokens"] > 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_mtp_drafts_are_mostly_accepted_on_the_trained_model(reference):
    engine = Engine(device="cpu", page_size=4, speculative={"method": "mtp", "num_speculative_tokens": 2})
    engine.generate(PROMPTS, GREEDY)
    stats = engine.stats()
    assert stats["spec_acceptance_rate"] > 0.5, stats
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + stats["spec_accepted_tokens"] / (
        stats["spec_draft_tokens"] / 2))


@pytest.mark.parametrize("error_rate,expect", [(0.0, "all"), (0.3, "some"), (1.0, "none")])
def test_replay_drafter_sets_acceptance_and_outputs_stay_identical(reference, error_rate, expect):
    k = 4  # with 4-token pages every verify row crosses page boundaries
    engine = Engine(device="cpu", page_size=4, speculative={
        "method": "replay", "num_speculative_tokens": k, "continuations": reference, "error_rate": error_rate})
    outs = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    accepted_in_one_step = []
    while engine.has_unfinished_requests():
        before = {rid: req.num_accepted for rid, req in engine.requests.items()}
        for out in engine.step():
            if out.request_id in before and out.new_token_ids:
                accepted_in_one_step.append(out.num_accepted_tokens - before[out.request_id])
            if out.finished:
                outs[out.request_id] = out
    for rid, out in outs.items():
        assert out.token_ids == reference[rid][:GREEDY.max_tokens]
    rate = engine.stats()["spec_acceptance_rate"]
    if expect == "all":
        assert rate == 1.0
    elif expect == "none":
        assert rate == 0.0
    else:
        assert 0.25 < rate < 0.7 and len(set(accepted_in_one_step)) >= 3, (rate, Counter(accepted_in_one_step))
    assert sum(o.num_draft_tokens for o in outs.values()) == engine.stats()["spec_draft_tokens"]


# ---- stochastic acceptance ---------------------------------------------------------------------

def chi2_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    keys = set(a) | set(b)
    stat = sum((a[x] - b[x]) ** 2 / (a[x] + b[x]) for x in keys)
    return stat, max(len(keys) - 1, 1)


def chi2_critical(df: int, z: float = 3.72) -> float:
    """Upper 1e-4 quantile of chi-square(df) (Wilson-Hilferty)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


@pytest.fixture(scope="module")
def small_vocab_mtp(tmp_path_factory):
    return write_mtp_checkpoint(tmp_path_factory.mktemp("mtp16"), vocab=16)


def token_samples(path, speculative, n: int, temperature: float = 1.0) -> list[tuple[int, ...]]:
    engine = Engine(str(path), device="cpu", page_size=4, max_num_seqs=512, speculative=speculative)
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    return [tuple(o.token_ids) for o in engine.generate([[3, 5, 7]] * n, params)]


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_stochastic_acceptance_preserves_the_target_distribution(small_vocab_mtp, method):
    n = 1500
    plain = token_samples(small_vocab_mtp, None, n)
    spec = token_samples(small_vocab_mtp, {"method": method, "num_speculative_tokens": 2}, n)
    for position in (1, 2):  # tokens that come out of verify steps
        stat, df = chi2_two_sample(Counter(t[position] for t in plain), Counter(t[position] for t in spec))
        assert stat < chi2_critical(df), (method, position, stat, df)
    # The same test separates two distributions that do differ (so it can fail).
    cooler = token_samples(small_vocab_mtp, None, n, temperature=0.6)
    stat, df = chi2_two_sample(Counter(t[1] for t in plain), Counter(t[1] for t in cooler))
    assert stat > chi2_critical(df)


# ---- pages ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory):
    path = write_mtp_checkpoint(tmp_path_factory.mktemp("mtp320"))
    # 12 usable pages of 4 tokens: preemptions happen; k = 3 drafts plus lookahead cross pages.
    return Engine(str(path), device="cpu", page_size=4, num_kv_pages=13, chunked_prefill_size=5,
                  max_num_batched_tokens=16, speculative={"method": "mtp", "num_speculative_tokens": 3})


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 12), st.integers(1, 9), st.sampled_from([0.0, 1.0])),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0), st.just(0.0)),
    st.tuples(st.just("abort"), st.integers(0, 20), st.just(0), st.just(0.0)),
), min_size=1, max_size=14)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_no_page_leak_or_double_use_with_speculation(spec_engine, ops):
    engine = spec_engine
    ids = []
    for op, a, b, temperature in ops:
        if op == "add":
            rid = f"s{len(ids)}"
            ids.append(rid)
            engine.add_request(rid, [(7 * a + j) % 300 + 2 for j in range(a)],
                               SamplingParams(max_tokens=b, temperature=temperature, seed=a, ignore_eos=True))
        elif op == "step":
            for _ in range(a):
                engine.step()
        elif ids:
            engine.abort(ids[a % len(ids)])
        check_invariants(engine.kv)
    while engine.has_unfinished_requests():
        engine.step()
        check_invariants(engine.kv)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    assert not engine.speculator.draft_probs


def test_speculative_config_errors_name_the_problem(v3_dir):
    with pytest.raises(ValueError, match="needs the checkpoint's nextn layer"):
        Engine(str(v3_dir), device="cpu", speculative={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'eagle3' is not implemented yet"):
        Engine(str(v3_dir), device="cpu", speculative={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 8\]"):
        Engine(str(v3_dir), device="cpu", speculative={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown speculative options"):
        Engine(str(v3_dir), device="cpu", speculative={"method": "ngram", "num_speculative_tokens": 1, "k": 2})
