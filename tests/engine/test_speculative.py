"""Speculative decoding: greedy outputs identical to plain decoding, acceptance really exercised,
stochastic acceptance preserving the target distribution, and no KV page leak."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints import write_eagle3_checkpoint, write_mtp_checkpoint
from encore.engine import Engine, SamplingParams
from encore.engine.spec import speculator
from test_kv_cache import run_ops
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
    engine = Engine(device="cpu", page_size=4, speculative={"method": method, "num_speculative_tokens": k},
                    **WORKLOADS[workload]["options"])
    check_greedy_run(engine, PROMPTS, GREEDY, reference, workload)


def test_speculative_logprobs_are_plain_decodings(reference):
    """A verify step's emitted tokens get the logprobs plain decoding gives them: the chosen token's and
    the request's own top n, whatever the other rows of the step ask (top 3, top 0, none, top 5);
    MTP k = 2 on the mixed workload (prefill rows sample beside verify rows)."""
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=n, ignore_eos=True) for n in (3, 0, None, 5)]
    arrivals, options = WORKLOADS["mixed"]["arrivals"], WORKLOADS["mixed"]["options"]
    want = run_staggered(Engine(device="cpu", page_size=4), PROMPTS, params, arrivals)
    spec = Engine(device="cpu", page_size=4, speculative={"method": "mtp", "num_speculative_tokens": 2}, **options)
    got = run_staggered(spec, PROMPTS, params, arrivals)
    assert spec.stats()["spec_accepted_tokens"] > 0
    for rid, out in want.items():
        assert got[rid].token_ids == out.token_ids == reference[rid][:12], rid
        if out.logprobs is None:
            assert got[rid].logprobs is None, rid
            continue
        pairs = list(zip(got[rid].logprobs, out.logprobs, strict=True))
        assert [(g.token_id, [t for t, _ in g.top]) for g, _ in pairs] == [
            (w.token_id, [t for t, _ in w.top]) for _, w in pairs], rid
        assert [g.logprob for g, _ in pairs] == pytest.approx([w.logprob for _, w in pairs], abs=1e-4), rid
        assert [v for g, _ in pairs for _, v in g.top] == pytest.approx([v for _, w in pairs for _, v in w.top],
                                                                          abs=1e-4), rid


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculation_with_penalties_is_token_identical(method):
    """Greedy rows with repetition and presence penalties, or a frequency penalty: each of a verify row's
    1 + k logits rows is penalized by the output so far plus the drafts before it (and the prompt), so
    the tokens are plain decoding's with the same penalties; a row without penalties shares the steps.
    Speculation with penalties had no test; this one fails when a logits row's history leaves out the
    drafts before it."""
    repeat = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.1,
                            ignore_eos=True)
    # Mild enough that the model still repeats itself: its drafts are accepted and then counted.
    frequency = SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=0.5, ignore_eos=True)
    params = [repeat, frequency, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), frequency]
    arrivals, options = WORKLOADS["mixed"]["arrivals"], WORKLOADS["mixed"]["options"]
    want = run_staggered(Engine(device="cpu", page_size=4), PROMPTS, params, arrivals)
    spec = Engine(device="cpu", page_size=4, speculative={"method": method, "num_speculative_tokens": 2}, **options)
    got = run_staggered(spec, PROMPTS, params, arrivals)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}
    assert spec.stats()["spec_accepted_tokens"] > 0
    if method == "mtp":  # penalties read each verify row's drafts on the host
        assert spec.stats()["drafts_read_back"] > 0
    # The penalties change the tokens (so the comparison above tests them).
    plain = run_staggered(Engine(device="cpu", page_size=4), PROMPTS, params[2], arrivals)
    assert any(plain[r].token_ids != want[r].token_ids for r in ("r0", "r1", "r3"))


def check_greedy_run(engine: Engine, prompts: list, params: SamplingParams, reference: dict, workload: str) -> dict:
    """Runs the workload on ``engine``: every output is its reference's prefix, drafts were made,
    no page leaked. Returns the engine's stats."""
    done = run_staggered(engine, prompts, params, WORKLOADS[workload]["arrivals"])
    for rid, out in done.items():
        assert out.token_ids == reference[rid][:params.max_tokens], (rid, workload)
    stats = engine.stats()
    if workload == "mixed":
        assert stats["steps"]["MIXED"] > 0, stats["steps"]
    # No head graphs on the CPU: every step with verify rows (all but prompt-only ones) verifies eager.
    assert stats["verify_eager_steps"] == stats["steps"]["DECODE"] + stats["steps"]["MIXED"] > 0, stats
    assert stats["spec_draft_tokens"] > 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    return stats


def test_mtp_drafts_are_mostly_accepted_on_the_trained_model(reference):
    engine = Engine(device="cpu", page_size=4, speculative={"method": "mtp", "num_speculative_tokens": 2})
    # 48 tokens a prompt: ~170 drafts, where GREEDY's 20 give ~80, too few to tell 0.5 from 0.6.
    engine.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    stats = engine.stats()
    assert stats["spec_acceptance_rate"] > 0.5, stats
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + stats["spec_accepted_tokens"] / (
        stats["spec_draft_tokens"] / 2))


def _mtp_run(arrivals, params, **options) -> tuple[dict, dict]:
    """A run of the MTP drafter (k = 2) on encore-tiny: the outputs and the engine's stats."""
    engine = Engine(device="cpu", page_size=4, speculative={"method": "mtp", "num_speculative_tokens": 2}, **options)
    return run_staggered(engine, PROMPTS, params, arrivals), engine.stats()


def test_drafts_fed_from_the_device_are_the_drafts_read_back(monkeypatch):
    """A model drafter's drafts stay on the device and feed the next step's verify rows; a run that
    reads every step's drafts to the host first (as if every row were left out of its next step) must
    accept the same drafts, token for token and count for count, greedy and seeded sampled rows alike.
    Garbage fed from the device would only be rejected (the tokens would still match): the accepted
    counts tell."""
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    params = [GREEDY, sampled, GREEDY, sampled]
    arrivals, options = WORKLOADS["mixed"]["arrivals"], WORKLOADS["mixed"]["options"]
    on_device, device_stats = _mtp_run(arrivals, params, **options)
    monkeypatch.setattr(speculator, "_left_out", lambda step, drafted: True)
    on_host, host_stats = _mtp_run(arrivals, params, **options)
    assert device_stats["drafts_read_back"] == 0, device_stats
    assert host_stats["drafts_read_back"] > 0, host_stats
    assert {r: (o.token_ids, o.num_accepted_tokens) for r, o in on_device.items()} == {
        r: (o.token_ids, o.num_accepted_tokens) for r, o in on_host.items()}
    assert device_stats["spec_acceptance_rate"] > 0.3, device_stats  # many drafts accepted: the counts tell


def test_a_drafting_row_left_out_of_the_next_step_reads_its_drafts(reference):
    """With too few pages for every row, rows are preempted after they drafted: the step that leaves
    them out reads the drafts to the host (they must outlive the buffer that holds them), and every
    row's tokens are still plain greedy decoding's."""
    done, stats = _mtp_run([0, 0, 0, 0], GREEDY, num_kv_pages=17, max_num_seqs=4)
    assert stats["preemptions"] > 0 and stats["drafts_read_back"] > 0, stats
    assert {r: o.token_ids for r, o in done.items()} == {r: reference[r][:GREEDY.max_tokens] for r in done}


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


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_a_request_can_opt_out_of_speculation(reference, method):
    """In one batch: rows that speculate and rows that opted out. The opted-out rows' greedy tokens are
    the plain ones and they count no drafts; their seeded samples equal a plain engine's draw for draw."""
    engine = Engine(device="cpu", page_size=4, speculative={"method": method, "num_speculative_tokens": 3})
    opted_out = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=False)
    params = [GREEDY, opted_out, GREEDY, opted_out]
    outputs = engine.generate(PROMPTS, params)
    for i, (out, p) in enumerate(zip(outputs, params)):
        assert out.token_ids == reference[f"r{i}"][:20], i
        if p.speculative is False:
            assert out.num_draft_tokens == out.num_accepted_tokens == 0
    assert sum(o.num_accepted_tokens for o in outputs) > 0  # the others did speculate and accept
    stats = engine.stats()
    assert stats["spec_draft_tokens"] == sum(o.num_draft_tokens for o in outputs)
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True, speculative=False)
               for s in range(4)]
    plain = Engine(device="cpu", page_size=4).generate(PROMPTS, sampled)
    assert [o.token_ids for o in engine.generate(PROMPTS, sampled)] == [o.token_ids for o in plain]


def test_speculation_asked_of_an_engine_without_it_is_refused():
    with pytest.raises(ValueError, match="speculative=True, but this engine runs without speculative decoding"):
        Engine(device="cpu", page_size=4).add_request("a", [1, 2], SamplingParams(speculative=True))


@pytest.fixture(scope="module")
def small_vocab_mtp(tmp_path_factory):
    return write_mtp_checkpoint(tmp_path_factory.mktemp("mtp16"), vocab=16)


@pytest.fixture(scope="module")
def small_vocab_eagle3(tmp_path_factory):
    """An EAGLE-3 drafter for small_vocab_mtp drafting over 10 of its 16 tokens."""
    return write_eagle3_checkpoint(tmp_path_factory.mktemp("eagle3_16"), vocab=16, draft_vocab=10)


def token_samples(path, speculative, n: int, temperature: float = 1.0) -> list[tuple[int, ...]]:
    engine = Engine(str(path), device="cpu", page_size=4, max_num_seqs=512, speculative=speculative)
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    return [tuple(o.token_ids) for o in engine.generate([[3, 5, 7]] * n, params)]


SAMPLES = 1500


@pytest.fixture(scope="module")
def plain_samples(small_vocab_mtp):
    return token_samples(small_vocab_mtp, None, SAMPLES)


@pytest.mark.parametrize("method", ["mtp", "eagle3", "ngram"])
def test_stochastic_acceptance_preserves_the_target_distribution(small_vocab_mtp, small_vocab_eagle3, plain_samples,
                                                                 method):
    draft = {"draft_model": str(small_vocab_eagle3)} if method == "eagle3" else {}
    spec = token_samples(small_vocab_mtp, {"method": method, "num_speculative_tokens": 2, **draft}, SAMPLES)
    for position in (1, 2):  # tokens that come out of verify steps
        stat, df = chi2_two_sample(Counter(t[position] for t in plain_samples), Counter(t[position] for t in spec))
        assert stat < chi2_critical(df), (method, position, stat, df)
    # The same test separates two distributions that do differ (so it can fail).
    cooler = token_samples(small_vocab_mtp, None, SAMPLES, temperature=0.6)
    stat, df = chi2_two_sample(Counter(t[1] for t in plain_samples), Counter(t[1] for t in cooler))
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
    run_ops(spec_engine, ops, lambda a, b, temperature: (
        [(7 * a + j) % 300 + 2 for j in range(a)],
        SamplingParams(max_tokens=b, temperature=temperature, seed=a, ignore_eos=True)))
    assert not spec_engine.speculator.draft_probs


def test_speculative_config_errors_name_the_problem(v3_dir, small_vocab_eagle3):
    with pytest.raises(ValueError, match="needs the checkpoint's nextn layer"):
        Engine(str(v3_dir), device="cpu", speculative={"method": "mtp", "num_speculative_tokens": 2})
    for draft, error in [(None, "'eagle3' needs draft_model"),
                         (str(v3_dir / "missing"), r"draft_model '.*missing' is not a directory"),
                         (str(v3_dir), r"\['DeepseekV3ForCausalLM'\] is not an EAGLE-3 drafter"),
                         (str(small_vocab_eagle3), r"is for a target of hidden size 64 and vocab 16; "
                                                   r"this model has 64 and 320")]:
        with pytest.raises(ValueError, match=error):
            Engine(str(v3_dir), device="cpu", speculative=eagle3(draft, 2))
    with pytest.raises(ValueError, match="draft_model is only for 'eagle3', got it with 'mtp'"):
        Engine(str(v3_dir), device="cpu", speculative={"method": "mtp", "num_speculative_tokens": 2,
                                                       "draft_model": str(small_vocab_eagle3)})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 8\]"):
        Engine(str(v3_dir), device="cpu", speculative={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown speculative options"):
        Engine(str(v3_dir), device="cpu", speculative={"method": "ngram", "num_speculative_tokens": 1, "k": 2})
    with pytest.raises(ValueError, match=r"options \{'method': 'ngram'\} lack \['num_speculative_tokens'\]"):
        Engine(str(v3_dir), device="cpu", speculative={"method": "ngram"})


# ---- EAGLE-3 -------------------------------------------------------------------------------------

E3_GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
E3_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(40, 53)), [7, 7, 7, 7]]


def eagle3(draft_model, k: int) -> dict:
    return {"method": "eagle3", "num_speculative_tokens": k, "draft_model": draft_model}


@pytest.fixture(scope="module")
def eagle3_targets(checkpoint, tmp_path_factory):
    """eagle3_targets(kind) -> (target dir, random drafter dir, plain greedy tokens by request id,
    with k extra tokens past E3_GREEDY.max_tokens for the acceptance model below)."""
    made = {}

    def get(kind: str):
        if kind not in made:
            target = checkpoint(kind)
            drafter = write_eagle3_checkpoint(tmp_path_factory.mktemp(f"eagle3_{kind}"))
            longer = SamplingParams(max_tokens=E3_GREEDY.max_tokens + 4, temperature=0.0, ignore_eos=True)
            outs = Engine(str(target), device="cpu", page_size=4).generate(E3_PROMPTS, longer)
            made[kind] = (target, drafter, {f"r{i}": o.token_ids for i, o in enumerate(outs)})
        return made[kind]

    return get


def check_counts(stats: dict, k: int) -> None:
    assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    verify_rows = stats["spec_draft_tokens"] / k
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + stats["spec_accepted_tokens"] / verify_rows)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("kind", ["v3", "v2_lite"])
@pytest.mark.parametrize("workload", ["decode", "mixed"])
def test_eagle3_greedy_speculation_is_token_identical(eagle3_targets, kind, k, workload):
    target, drafter, reference = eagle3_targets(kind)
    engine = Engine(str(target), device="cpu", page_size=4, speculative=eagle3(str(drafter), k),
                    **WORKLOADS[workload]["options"])
    stats = check_greedy_run(engine, E3_PROMPTS, E3_GREEDY, reference, workload)
    assert stats["drafter_eager_steps"] > 0
    check_counts(stats, k)


def expected_accepted(tokens: list[int], draft: int, k: int, max_tokens: int) -> int:
    """Drafts accepted for one request whose drafter always proposes ``draft``: each verify step,
    after the token sampled at prefill, accepts the run of ``draft`` that starts at its next token."""
    accepted, j = 0, 1
    while j < max_tokens:
        a = 0
        while a < k and tokens[j + a] == draft:
            a += 1
        accepted += a
        j += a + 1
    return accepted


def test_eagle3_acceptance_is_exact_with_a_drafter_that_agrees_sometimes(eagle3_targets, tmp_path):
    """A drafter with a one-token draft vocab proposes that token, whatever its weights: drafting
    the target's most frequent output token, it must accept exactly the runs of it in the output."""
    k = 3
    target, _, reference = eagle3_targets("v3")
    frequent = Counter(t for out in reference.values() for t in out[1:E3_GREEDY.max_tokens]).most_common(1)[0][0]
    drafter = write_eagle3_checkpoint(tmp_path, target_ids=[frequent])
    engine = Engine(str(target), device="cpu", page_size=4, speculative=eagle3(str(drafter), k))
    done = run_staggered(engine, E3_PROMPTS, E3_GREEDY, [0] * len(E3_PROMPTS))
    for rid, out in done.items():
        assert out.token_ids == reference[rid][:E3_GREEDY.max_tokens]
    want = sum(expected_accepted(out, frequent, k, E3_GREEDY.max_tokens) for out in reference.values())
    stats = engine.stats()
    assert want > 0 and stats["spec_accepted_tokens"] == want, (frequent, reference)
    assert sum(o.num_accepted_tokens for o in done.values()) == want
    check_counts(stats, k)


def test_eagle3_stochastic_run_is_reproducible_and_accepts(small_vocab_mtp, small_vocab_eagle3):
    def run() -> tuple[list[list[int]], dict]:
        engine = Engine(str(small_vocab_mtp), device="cpu", page_size=4, speculative=eagle3(str(small_vocab_eagle3), 3))
        params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in range(4)]
        outs = engine.generate([[3, 5, 7], [2], [9, 9, 4, 1], [6, 6]], params)
        assert not engine.speculator.draft_probs
        return [o.token_ids for o in outs], engine.stats()

    first, stats = run()
    assert run()[0] == first
    assert stats["spec_accepted_tokens"] > 0, stats
    check_counts(stats, 3)


def test_eagle3_with_a_compiled_target_is_token_identical(eagle3_targets):
    """The auxiliary states come out of the compiled graphs (one output per key) as out of eager
    steps. Decode keys for verify steps only (graph_q_lens = 1 + k): a DECODE and an EXTEND key
    compile, and no MIXED key fits the 12-token step budget."""
    from graph_helpers import SMALL_KEYS, STAGGERED

    target, drafter, reference = eagle3_targets("v3")
    engine = Engine(str(target), device="cpu", compile=True, speculative=eagle3(str(drafter), 2),
                    **STAGGERED, **{**SMALL_KEYS, "graph_q_lens": (3,)})
    done = run_staggered(engine, E3_PROMPTS, E3_GREEDY, [0, 1, 3, 4])
    assert {r: o.token_ids for r, o in done.items()} == {r: t[:E3_GREEDY.max_tokens] for r, t in reference.items()}
    stats = engine.stats()
    # No MIXED key fits 12 tokens: those steps run eager; every other step runs compiled.
    assert stats["compiled_keys"] == 2, stats
    assert stats["eager_steps"] == stats["steps"]["MIXED"] > 0 and stats["recompiles"] == 0, stats
    assert stats["compiled_steps"] + stats["eager_steps"] == sum(stats["steps"].values()), stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_eagle3_cuda_graphs_greedy_matches_plain(v3_dir, tmp_path, compiled):
    """The auxiliary states come out of captured CUDA graphs (one output buffer per key) and the
    drafter's paged attention runs on CUDA; float32, so greedy tokens are exact."""
    drafter = write_eagle3_checkpoint(tmp_path)
    options = dict(dtype="float32", page_size=4, max_model_len=256)
    want = [o.token_ids for o in Engine(str(v3_dir), device="cuda", compile=False, cuda_graphs=False,
                                        **options).generate(E3_PROMPTS, E3_GREEDY)]
    small_keys = dict(graph_decode_sizes=(1, 2, 4), graph_q_lens=(4,), graph_mixed_decode_sizes=(4,),
                      graph_prefill_tokens=(64,), graph_extend_sizes=(1,), graph_mixed_extends=(1,))
    spec = Engine(str(v3_dir), device="cuda", compile=compiled, cuda_graphs=True, speculative=eagle3(str(drafter), 3),
                  **options, **small_keys)
    assert [o.token_ids for o in spec.generate(E3_PROMPTS, E3_GREEDY)] == want
    stats = spec.stats()
    assert stats["graph_replays"] > 0 and stats["drafter_graph_replays"] > 0 and stats["drafter_eager_steps"] > 0, stats
    # The draft graphs run the compiled drafter, compiled or loaded from the graph cache.
    assert (stats["drafter_compiles"] > 0 or stats["drafter_loaded"]) == compiled, stats
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


# ---- draft picks and draft steps -----------------------------------------------------------------

def test_greedy_picks_are_the_argmax_of_the_float32_logits(v3_dir, tmp_path):
    """The head graphs and greedy drafts take the argmax of the heads' own (bf16) output, skipping the
    float32 cast of ``compute_logits``: the same token, ties included (both take the first). EAGLE-3's
    pick maps the draft vocab's argmax to target ids without building the target-vocab logits."""
    tiny = Engine(device="cpu", dtype="bfloat16", speculative={"method": "mtp", "num_speculative_tokens": 1})
    hidden = torch.randn(512, tiny.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.bfloat16()
    model = tiny.runner.model
    assert torch.equal(model.greedy_tokens(hidden), model.compute_logits(hidden).argmax(dim=-1))
    assert torch.equal(model.mtp.greedy_tokens(hidden), model.mtp.compute_logits(hidden).argmax(dim=-1))
    drafter = write_eagle3_checkpoint(tmp_path)
    engine = Engine(str(v3_dir), device="cpu", speculative=eagle3(str(drafter), 2))
    head = engine.runner.eagle3
    states = torch.randn(64, head.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    assert torch.equal(head.greedy_tokens(states), head.compute_logits(states).argmax(dim=-1))


def test_later_draft_steps_are_decode_steps_at_the_next_positions():
    """Draft steps 2..k built in one pass: step s reads position p + s of each row, its slot in the
    row's own pages, lengths p + s + 1, and is fed the draft made just before it."""
    from encore.engine.spec.speculator import _later_draft_steps

    page_size, k = 4, 4
    positions = torch.tensor([3, 9, 14])
    table = torch.tensor([[5, 6, 0, 0, 0], [7, 8, 9, 0, 0], [1, 2, 3, 4, 10]], dtype=torch.int32)
    drafts = [torch.tensor([100, 101, 102])]
    seen = 0
    for s, step in enumerate(_later_draft_steps(positions, table, page_size, torch.arange(1, k + 1)[:, None],
                                                drafts), start=1):
        at = positions + s
        assert torch.equal(step.positions, at) and step.input_ids is drafts[-1]
        assert step.seq_lens.dtype == torch.int32 and torch.equal(step.seq_lens, (at + 1).int())
        assert torch.equal(step.prefix_lens, at.int())
        want = [int(table[b, int(p) // page_size]) * page_size + int(p) % page_size for b, p in enumerate(at)]
        assert step.slot_mapping.tolist() == want and step.slot_mapping.is_contiguous()
        assert (step.bs, step.q_len_per_req, step.num_tokens) == (3, 1, 3)
        drafts.append(drafts[-1] + 10)
        seen += 1
    assert seen == k - 1
    assert list(_later_draft_steps(positions, table, page_size, torch.ones(1, 1, dtype=torch.long), [])) == []
