"""Prefix caching on the GPU backends with CUDA graphs: requests that start from cached pages produce the
tokens they produce without the cache (float32 Triton exactly; bf16 flashinfer up to a near tie)."""

from __future__ import annotations

import pytest
import torch

from encore.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KEYS = dict(graph_decode_sizes=(1, 2, 4), graph_mixed_decode_sizes=(4,), graph_prefill_tokens=(64,),
            graph_extend_sizes=(1, 4), graph_mixed_extends=(1, 4))
SHARED = [(31 * i + 7) % 250 + 40 for i in range(53)]  # 3 pages of 16, then 5 tokens
QUESTIONS = [[5, 9, 40], [17, 3, 3, 8, 21], [300, 301], [12] * 9]
GAP = 0.05  # as in test_flashinfer_backend: a bf16 near tie either kernel may break either way


def waves(engine: Engine, params: SamplingParams):
    """The first prompt alone, then all of them at once, the second wave starting from the first's pages."""
    prompts = [SHARED + q for q in QUESTIONS]
    return engine.generate(prompts[:1], params) + engine.generate(prompts, params)


@pytest.mark.parametrize("speculative", [None, {"method": "mtp", "num_speculative_tokens": 2}], ids=["plain", "mtp"])
def test_triton_float32_cached_prefix_tokens_equal_uncached(speculative):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", max_model_len=256, attention_backend="triton", compile=False,
                   cuda_graphs=True, speculative=speculative, **KEYS)
    on, off = Engine(**options), Engine(enable_prefix_caching=False, **options)
    got, want = waves(on, params), waves(off, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.num_accepted_tokens for o in got] == [o.num_accepted_tokens for o in want]
    assert [o.num_cached_tokens for o in got[1:]] == [48] * len(QUESTIONS)  # the next token matches too
    stats = on.stats()
    assert stats["graph_replays"] > 0 and stats["prefix_cache_hit_tokens"] == 48 * len(QUESTIONS), stats
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_flashinfer_bfloat16_cached_prefix_tokens_equal_uncached(tmp_path):
    from checkpoints import write_checkpoint

    model = write_checkpoint("v2_lite", tmp_path, overrides=dict(kv_lora_rank=128, qk_nope_head_dim=128,
                                                                 qk_rope_head_dim=64, v_head_dim=128))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    options = dict(model=str(model), device="cuda", dtype="bfloat16", max_model_len=256, **KEYS)
    on, off = Engine(**options), Engine(enable_prefix_caching=False, **options)
    assert on.runner.backend.name == "flashinfer"
    got, want = waves(on, params), waves(off, params)
    compared = 0
    for ref, out in zip(want, got):
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in ref.logprobs]
        exact = next((i for i, gap in enumerate(gaps) if gap < GAP), len(gaps))
        assert out.token_ids[:exact] == ref.token_ids[:exact], (ref.token_ids, out.token_ids, gaps)
        compared += exact
    assert compared >= 2 * len(got), compared
    assert [o.num_cached_tokens for o in got[1:]] == [48] * len(QUESTIONS)
    stats = on.stats()
    assert stats["graph_replays"] > 0 and stats["attention_fallback_steps"] == 0, stats
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
