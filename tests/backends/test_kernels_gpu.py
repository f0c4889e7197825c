"""GPU kernels of the compiled path against the references, and their CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from encore.backends.moe import experts_grouped, experts_torch
from encore.backends.rope import apply_rotary
from encore.backends.rope_cache_triton import rope_cache_write_triton

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_cache_write_kernel_matches_reference(dtype, tol, interleaved):
    torch.manual_seed(0)
    T, H, dn, dr, R = 37, 16, 128, 64, 512  # V2-Lite's MLA dims
    q = torch.randn(T, H, dn + dr, device="cuda").to(dtype)
    kv = torch.randn(T, R + dr, device="cuda").to(dtype)
    q_pe, (kv_c, k_pe) = q[..., dn:], kv.split([R, dr], dim=-1)
    cos_sin, positions = torch.randn(4096, dr, device="cuda"), torch.randint(0, 4096, (T,), device="cuda")
    slots = torch.randperm(100 * 16, device="cuda")[:T]
    cache = torch.zeros(100, 16, R + dr, dtype=dtype, device="cuda")
    want_cache = cache.clone()
    got = rope_cache_write_triton(positions, q_pe, kv_c, k_pe, cos_sin, cache, slots, interleaved)
    want_q, want_k = apply_rotary(positions, q_pe, k_pe, cos_sin, interleaved)
    want_cache.view(-1, R + dr)[slots] = torch.cat([kv_c, want_k], dim=-1)
    for a, b in ((got, want_q), (cache, want_cache)):
        assert ((a.float() - b.float()).abs() / b.float().abs().clamp(min=1)).max().item() <= tol


def test_grouped_experts_bf16_match_reference_and_replay():
    torch.manual_seed(0)
    E, k, H, I, T = 64, 6, 2048, 1408, 64  # V2-Lite's routed experts
    w13 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).bfloat16()

    def inputs():
        x = torch.randn(T, H, device="cuda").bfloat16()
        ids = torch.rand(T, E, device="cuda").topk(k, dim=-1).indices
        return x, torch.rand(T, k, device="cuda"), ids

    x, weights, ids = inputs()
    want = experts_torch(x, w13, w2, weights, ids).float()
    assert ((experts_grouped(x, w13, w2, weights, ids).float() - want).abs().max() / want.abs().max()) < 2e-2
    static = [t.clone() for t in (x, weights, ids)]
    experts_grouped(static[0], w13, w2, static[1], static[2])  # warm-up before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_grouped(static[0], w13, w2, static[1], static[2])
    fresh = inputs()
    for buf, new in zip(static, fresh):
        buf.copy_(new)
    graph.replay()
    assert torch.equal(out, experts_grouped(*fresh[:1], w13, w2, *fresh[1:]))
