"""The same engine code on the GPU: float32 CUDA greedy tokens equal the CPU's (torch backend)."""

from __future__ import annotations

import pytest
import torch

from encore.engine import Engine, SamplingParams
from workloads import run_staggered

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(40, 73))]


@pytest.mark.parametrize("kind", ["v2_lite", "v3"])
def test_cuda_float32_greedy_equals_cpu(kind, checkpoint):
    path = str(checkpoint(kind))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(dtype="float32", page_size=4, chunked_prefill_size=8, max_num_batched_tokens=16,
                   compile=False, cuda_graphs=False)
    cpu = Engine(path, device="cpu", **{k: v for k, v in options.items() if k not in ("compile", "cuda_graphs")})
    gpu = Engine(path, device="cuda", **options)
    want = [o.token_ids for o in cpu.generate(PROMPTS, params)]
    assert [o.token_ids for o in gpu.generate(PROMPTS, params)] == want


def test_cuda_bfloat16_runs(v3_dir):
    engine = Engine(str(v3_dir), device="cuda", dtype="bfloat16", page_size=16, compile=False, cuda_graphs=False)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs)
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
    assert torch.get_num_threads() == 1  # model_runner.serial_host_ops


def test_a_cuda_engine_allocates_in_expandable_segments(v3_dir, monkeypatch):
    """model_runner.expandable_segments: memory allocated after a CUDA engine is built lies in an
    expandable segment (with fixed segments, V2-Lite's shape ran out of memory on an H100)."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    Engine(str(v3_dir), device="cuda", dtype="bfloat16", page_size=16, compile=False, cuda_graphs=False)
    # Larger than any fixed segment that earlier tests of this process left (a free block in one would
    # serve it, and an allocator setting does not change segments that exist): only a new segment holds it.
    fixed = [s["total_size"] for s in torch.cuda.memory_snapshot() if not s["is_expandable"]]
    block = torch.empty(max([64 << 20, *fixed]) + (2 << 20), dtype=torch.uint8, device="cuda")
    segment, = (s for s in torch.cuda.memory_snapshot()
                if s["address"] <= block.data_ptr() < s["address"] + s["total_size"])
    assert segment["is_expandable"], segment


def test_a_step_no_key_holds_runs_compiled_in_a_process_with_a_thread_pool(tmp_path):
    """Graphs compiled before the engine gave up torch's pool rejected every later call (dynamo guards
    the thread count), so a step no key holds ran eager: here a 100-token prompt, past every key."""
    torch.set_num_threads(4)
    engine = Engine(device="cuda", dtype="bfloat16", max_model_len=256, graph_cache_dir=str(tmp_path),
                    graph_decode_sizes=(1,), graph_mixed_decode_sizes=(1,), graph_prefill_tokens=(32,),
                    graph_extend_sizes=(1,), graph_mixed_extends=(1,))
    engine.generate([list(range(5, 105))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    stats = engine.stats()
    assert stats["eager_steps"] == 0 and stats["compiled_steps"] >= 1, stats
    assert torch.get_num_threads() == 1  # model_runner.serial_host_ops


def test_a_burst_as_large_as_the_row_budget_replays_on_capped_keys(tmp_path):
    """With 6 rows a step, the 16-row prefill buckets become 5-row MIXED and 6-row EXTEND keys
    (graphs/keys.build_keys): a burst of 5 arrivals joining a running request, and one of 6 into an
    idle engine, replay graphs (no step eager) with the greedy tokens of a plain engine."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3 + i, 5 + i + i % 4)) for i in range(12)]  # 2-5 tokens: a burst fits 64
    arrivals = [0] + [2] * 5 + [30] * 6  # 30: after the first six have finished
    options = dict(dtype="float32", max_model_len=256, max_num_seqs=6)
    plain = Engine(device="cuda", compile=False, cuda_graphs=False, **options)
    want = {k: v.token_ids for k, v in run_staggered(plain, prompts, params, arrivals).items()}
    graphs = Engine(device="cuda", compile=False, graph_cache_dir=str(tmp_path), graph_decode_sizes=(1, 2, 4, 8),
                    graph_mixed_extends=(16,), graph_mixed_decode_sizes=(4,), graph_prefill_tokens=(64,),
                    graph_extend_sizes=(16,), **options)
    got = {k: v.token_ids for k, v in run_staggered(graphs, prompts, params, arrivals).items()}
    assert got == want
    stats = graphs.stats()
    assert stats["eager_steps"] == 0 and stats["steps"]["MIXED"] >= 1, stats  # compile=False: no compiled steps
    assert stats["graph_replays"] == sum(stats["steps"].values()), stats


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_sampled_speculative_steps_replay_graphs_with_the_eager_steps_tokens(method):
    """Steps with sampling rows verify in the DECODE keys' stochastic heads (engine/head_graphs.py) and
    MTP draws its drafts in the keys' stochastic draft graphs (one replay drafts k tokens and keeps
    their distributions; n-gram proposals are deterministic): the tokens are an eager engine's (no CUDA
    graphs, float32), so the graphs draw the same drafts, keep the same distributions and reach the same
    verdicts. Greedy, top-k with top-p, and min-p rows share steps (the graphs that truncate, then,
    once the first row is done, those that do not); prompts arrive beside running verify rows (MIXED
    steps), the last one opted out of speculation (its steps verify eager). No MTP step drafts eager,
    and KV pages all come back."""
    prompts = SPEC_PROMPTS + ["for i in range(10):"]
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=1, ignore_eos=True),
              SPEC_GREEDY, SamplingParams(max_tokens=24, temperature=1.0, min_p=0.05, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.7, seed=3, speculative=False, ignore_eos=True)]
    arrivals = [0, 0, 3, 8]
    options = dict(dtype="float32", max_model_len=256, compile=False, max_num_seqs=4,
                   speculative={"method": method, "num_speculative_tokens": 3})
    eager = Engine(device="cuda", cuda_graphs=False, **options)
    want = {r: o.token_ids for r, o in run_staggered(eager, prompts, params, arrivals).items()}
    spec = Engine(device="cuda", cuda_graphs=True, graph_decode_sizes=(1, 2, 4), graph_mixed_decode_sizes=(3,),
                  graph_prefill_tokens=(16,), graph_extend_sizes=(1, 2), graph_mixed_extends=(1,), **options)
    got = {r: o.token_ids for r, o in run_staggered(spec, prompts, params, arrivals).items()}
    assert got == want
    stats = spec.stats()
    assert stats["steps"]["MIXED"] > 0 and stats["spec_accepted_tokens"] > 0 and stats["eager_steps"] == 0, stats
    assert 0 < stats["head_graph_replays"] < stats["steps"]["DECODE"], stats  # not with the opted-out row
    if method == "mtp":
        assert stats["drafter_eager_steps"] == 0, stats
        assert stats["drafter_graph_replays"] == sum(stats["steps"].values()), stats
    assert not spec.speculator.draft_probs and stats["kv_pages_free"] == stats["kv_pages_total"], stats


def test_keys_past_the_stochastic_row_cap_capture_and_sample_eager():
    """A verify key of more rows than head_graphs.MAX_STOCHASTIC_ROWS gets greedy graphs only (capture
    once failed on it: the stochastic buffers are sized to the cap); sampled rows that run on it draft and
    verify eager, counted in stats, and give the eager engine's tokens."""
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True)
    options = dict(dtype="float32", max_model_len=256, compile=False, max_num_seqs=96,
                   speculative={"method": "mtp", "num_speculative_tokens": 2})
    want = [o.token_ids for o in Engine(device="cuda", cuda_graphs=False, **options).generate(SPEC_PROMPTS, params)]
    spec = Engine(device="cuda", cuda_graphs=True, graph_decode_sizes=(1, 96), graph_mixed_decode_sizes=(2,),
                  graph_prefill_tokens=(128,), graph_extend_sizes=(1,), graph_mixed_extends=(1,), **options)
    assert [o.token_ids for o in spec.generate(SPEC_PROMPTS, params)] == want
    stats = spec.stats()
    assert stats["graph_replays"] > 0 and stats["drafter_eager_steps"] > 0 and stats["verify_eager_steps"] > 0, stats
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats


def test_cuda_seeded_sampling_is_batch_independent(v3_dir):
    engine = Engine(str(v3_dir), device="cuda", dtype="float32", page_size=16, compile=False, cuda_graphs=False)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], params)[0].token_ids
    crowd = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], params)[1].token_ids
    assert alone == crowd and len(alone) == 16


def test_plain_steps_of_every_request_kind_never_wait_for_the_device(tmp_path):
    """With overlap on, a step reads the step before it back through an event; nothing else may make
    the host wait for the device, or the next step launches late. The penalties' token lists did (a
    copy through ``torch.tensor(..., device=cuda)``, session 39). encore-tiny, CUDA graphs, each kind's
    requests once to warm up, then again under torch's sync debug mode."""
    engine = Engine(device="cuda", dtype="bfloat16", max_num_seqs=8, graph_cache_dir=str(tmp_path))
    kinds = {
        "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        "top-p": SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
        "penalties": SamplingParams(max_tokens=24, temperature=0.8, repetition_penalty=1.1, presence_penalty=0.2,
                                    frequency_penalty=0.1, seed=1, ignore_eos=True),
        "logprobs": SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True),
        "stop": SamplingParams(max_tokens=24, temperature=0.0, stop=("zzzz",), ignore_eos=True),
        "min_tokens": SamplingParams(max_tokens=24, temperature=0.0, min_tokens=8),
        "json": SamplingParams(max_tokens=24, temperature=0.0, json_object=True),
    }
    prompt = "def fibonacci(n):\n    " * 8
    for name, params in kinds.items():
        for checked in (False, True):
            for i in range(4):
                engine.add_request(f"{name}-{checked}-{i}", prompt, params)
            if checked:
                torch.cuda.set_sync_debug_mode("error")
            try:
                while engine.has_unfinished_requests():
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    assert engine.stats()["graph_replays"] > 0


SPEC_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
SPEC_GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SPEC_KEYS = dict(graph_decode_sizes=(1, 2, 4), graph_mixed_decode_sizes=(4,), graph_prefill_tokens=(64,),
                 graph_extend_sizes=(1,), graph_mixed_extends=(1,))


@pytest.fixture(scope="module")
def tiny_plain_tokens():
    plain = Engine(device="cuda", dtype="float32", max_model_len=256, compile=False, cuda_graphs=False)
    return [o.token_ids for o in plain.generate(SPEC_PROMPTS, SPEC_GREEDY)]


@pytest.mark.parametrize("method,k", [("mtp", 1), ("mtp", 2), ("mtp", 4), ("ngram", 3)])
def test_cuda_graph_speculative_greedy_matches_plain(method, k, tiny_plain_tokens):
    """Verify steps replay the target's graphs and verify in the keys' greedy head graphs; MTP's
    greedy drafts replay its draft graphs (a prefill step on no key drafts eager)."""
    spec = Engine(device="cuda", dtype="float32", max_model_len=256, compile=False, cuda_graphs=True,
                  speculative={"method": method, "num_speculative_tokens": k}, **SPEC_KEYS)
    assert [o.token_ids for o in spec.generate(SPEC_PROMPTS, SPEC_GREEDY)] == tiny_plain_tokens
    stats = spec.stats()
    assert stats["graph_replays"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert stats["head_graph_replays"] == stats["steps"]["DECODE"] > 0, stats
    if method == "mtp":
        assert stats["drafter_graph_replays"] > stats["drafter_eager_steps"] > 0, stats
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_compiled_drafter_takes_eager_drafts_decode_steps(tiny_plain_tokens):
    """A prefill step's draft runs its first pass eager and its decode-only steps on the compiled
    drafter, their table padded to the width it was compiled for: greedy tokens equal plain and
    nothing compiles while serving."""
    spec = Engine(device="cuda", dtype="float32", max_model_len=256, compile=True, cuda_graphs=True,
                  speculative={"method": "mtp", "num_speculative_tokens": 3}, **SPEC_KEYS)
    drafter = spec.speculator.compiled_drafter
    built = spec.stats()
    assert built["drafter_compiles"] > 0 or built["drafter_loaded"], built  # compiled, or loaded from the graph cache
    calls = []  # the draft graphs replay without calling it: every call is an eager draft's
    family = drafter._family
    drafter._family = lambda inputs, shape: calls.append(shape) or family(inputs, shape)
    assert [o.token_ids for o in spec.generate(SPEC_PROMPTS, SPEC_GREEDY)] == tiny_plain_tokens
    stats = spec.stats()
    assert stats["drafter_eager_steps"] > 0 and stats["drafter_compiles"] == built["drafter_compiles"], stats
    assert len(calls) == 2 * stats["drafter_eager_steps"], (len(calls), stats)  # k - 1 decode passes each
    assert stats["recompiles"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"], stats


def test_prefill_steps_draft_in_graphs(tiny_plain_tokens):
    """Steps with prefill rows that run on a key draft in that key's draft graph: an EXTEND step of a
    prompt, then MIXED steps where a prompt arrives beside verify rows (its own first draft and theirs
    in one replay). Greedy tokens equal plain; no step drafts eager; KV pages all come back."""
    spec = Engine(device="cuda", dtype="float32", max_model_len=256, compile=False, cuda_graphs=True,
                  speculative={"method": "mtp", "num_speculative_tokens": 3}, max_num_seqs=4,
                  graph_decode_sizes=(1, 2, 4), graph_mixed_decode_sizes=(3,), graph_prefill_tokens=(16,),
                  graph_extend_sizes=(1,), graph_mixed_extends=(1,))
    done = run_staggered(spec, SPEC_PROMPTS, SPEC_GREEDY, [0, 3, 5])
    assert [done[f"r{i}"].token_ids for i in range(3)] == tiny_plain_tokens
    stats = spec.stats()
    assert stats["steps"]["EXTEND"] > 0 and stats["steps"]["MIXED"] > 0, stats
    assert stats["drafter_eager_steps"] == 0 and stats["eager_steps"] == 0, stats
    assert stats["drafter_graph_replays"] == sum(stats["steps"].values()), stats
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats
