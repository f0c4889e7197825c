"""The same engine code on the GPU: float32 CUDA greedy tokens equal the CPU's (torch backend)."""

from __future__ import annotations

import pytest
import torch

from encore.engine import Engine, SamplingParams

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


def test_cuda_seeded_sampling_is_batch_independent(v3_dir):
    engine = Engine(str(v3_dir), device="cuda", dtype="float32", page_size=16, compile=False, cuda_graphs=False)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], params)[0].token_ids
    crowd = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], params)[1].token_ids
    assert alone == crowd and len(alone) == 16


@pytest.mark.parametrize("method,k", [("mtp", 1), ("mtp", 2), ("mtp", 4), ("ngram", 3)])
def test_cuda_graph_speculative_greedy_matches_plain(method, k):
    """Verify steps replay the target's graphs; MTP's greedy drafts of DECODE steps replay its draft
    graphs (prefill steps draft eager)."""
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    small_keys = dict(graph_decode_sizes=(1, 2, 4), graph_mixed_decode_sizes=(4,), graph_prefill_tokens=(64,),
                      graph_extend_sizes=(1,), graph_mixed_extends=(1,))
    plain = Engine(device="cuda", dtype="float32", max_model_len=256, compile=False, cuda_graphs=False)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    spec = Engine(device="cuda", dtype="float32", max_model_len=256, compile=False, cuda_graphs=True,
                  speculative={"method": method, "num_speculative_tokens": k}, **small_keys)
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    stats = spec.stats()
    assert stats["graph_replays"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    if method == "mtp":
        assert stats["drafter_graph_replays"] > stats["drafter_eager_steps"] > 0, stats
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
