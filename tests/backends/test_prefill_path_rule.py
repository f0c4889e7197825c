"""The eager prefill path rule (``MLADims.absorbed_prefill_is_cheaper``): FLOP counts of absorbed MLA
against MHA over the decompressed prefix, checked on the H200 by benchmarks/bench_mla_prefill_paths.py."""

from __future__ import annotations

from encore.backends.base import MLADims

V2_LITE = MLADims(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                  softmax_scale=192 ** -0.5)


def test_a_long_cached_prefix_under_few_new_tokens_goes_absorbed():
    assert V2_LITE.absorbed_prefill_is_cheaper([32] * 64, [2048] * 64)  # measured 2688 -> 529 µs a layer
    assert V2_LITE.absorbed_prefill_is_cheaper([64] * 8, [4096] * 8)


def test_new_prompts_and_long_chunks_stay_mha():
    assert not V2_LITE.absorbed_prefill_is_cheaper([1000] * 4, [0] * 4)
    assert not V2_LITE.absorbed_prefill_is_cheaper([512], [8192])  # measured 403 (MHA) vs 491 µs
    assert not V2_LITE.absorbed_prefill_is_cheaper([256] * 4, [256] * 4)


def test_the_crossover_follows_the_dims():
    # One row of 32 new tokens: decompressing p latents costs 2 097 152·p MACs, the wider absorbed
    # attention 393 216·(p + 16.5): absorbed from p = 4 on.
    assert V2_LITE.absorbed_prefill_is_cheaper([32], [4]) and not V2_LITE.absorbed_prefill_is_cheaper([32], [3])
    narrow = MLADims(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=128,
                     softmax_scale=1.0)  # a small latent: absorbed scores are as wide as MHA's, and win sooner
    assert narrow.absorbed_prefill_is_cheaper([512], [8192])
