"""The fused RoPE + cache-write Triton kernel against the reference, run by Triton's CPU interpreter
(in a subprocess: TRITON_INTERPRET must be set before Triton compiles anything)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from encore.backends.dense import rms_norm
    from encore.backends.rope import apply_rotary
    from encore.backends.rope_cache_triton import rope_cache_write_triton

    torch.manual_seed(0)
    T, H, dn, dr, R = 7, 5, 16, 8, 32
    for interleaved, kv_norm in ((True, False), (False, False), (True, True)):
        # bf16 with the norm: the normed row and its product with the weight are each rounded, and a
        # summation order other than torch's may flip either rounding by a unit in the last place.
        for dtype, tol in ((torch.float32, 1e-6 if kv_norm else 0.0), (torch.bfloat16, 2 ** (-6 if kv_norm else -7))):
            q = torch.randn(T, H, dn + dr).to(dtype)
            kv = torch.randn(T, R + dr).to(dtype)
            q_pe, (kv_c, k_pe) = q[..., dn:], kv.split([R, dr], dim=-1)  # strided views, as in the model
            cos_sin, positions = torch.randn(64, dr), torch.randint(0, 64, (T,))
            slots = torch.randperm(40)[:T]
            cache = torch.zeros(10, 4, R + dr, dtype=dtype)
            want_cache = cache.clone()
            norm_weight = (1 + 0.5 * torch.randn(R)).to(dtype) if kv_norm else None
            got_q = rope_cache_write_triton(positions, q_pe, kv_c, k_pe, cos_sin, cache, slots, interleaved,
                                            norm_weight, 1e-6)
            want_q, want_k = apply_rotary(positions, q_pe, k_pe, cos_sin, interleaved)
            want_kv = rms_norm(kv_c, norm_weight, 1e-6) if kv_norm else kv_c
            want_cache.view(-1, R + dr)[slots] = torch.cat([want_kv, want_k], dim=-1)
            for got, want in ((got_q, want_q), (cache, want_cache)):
                err = ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1)).max().item()
                assert err <= tol, (interleaved, dtype, err)
    try:
        rope_cache_write_triton(positions, q_pe, kv_c, k_pe, cos_sin.double(), cache, slots, True)
    except ValueError as exc:
        assert "cos_sin must be float32" in str(exc)
    else:
        raise AssertionError("a float64 table was accepted")
    try:
        rope_cache_write_triton(positions, q_pe, kv_c, k_pe, cos_sin, cache, slots, True, torch.ones(R + 1), 1e-6)
    except ValueError as exc:
        assert "kv_norm_weight must be contiguous [32]" in str(exc), exc
    else:
        raise AssertionError("a norm weight of another size was accepted")
    # One token with its latent query in the same launch: the same RoPE, cache and q_pe as the kernel
    # above, and the batched GEMV's latent query, bit for bit.
    from encore.backends.gemv_triton import batched_gemv
    from encore.backends.rope_cache_triton import rope_absorb_triton

    for dtype, kv_norm in ((torch.float32, False), (torch.bfloat16, True)):
        q = torch.randn(1, H, dn + dr).to(dtype)
        kv = torch.randn(1, R + dr).to(dtype)
        q_nope, q_pe, (kv_c, k_pe) = q[..., :dn], q[..., dn:], kv.split([R, dr], dim=-1)
        w_kc = torch.randn(H, dn, R).to(dtype)
        positions, slots = torch.tensor([5]), torch.tensor([13])
        norm_weight = (1 + 0.5 * torch.randn(R)).to(dtype) if kv_norm else None
        cache, want_cache = torch.zeros(10, 4, R + dr, dtype=dtype), torch.zeros(10, 4, R + dr, dtype=dtype)
        got_q, got_lat = rope_absorb_triton(positions, q_nope, q_pe, kv_c, k_pe, cos_sin, w_kc, cache, slots, False,
                                            norm_weight, 1e-6)
        want_q = rope_cache_write_triton(positions, q_pe, kv_c, k_pe, cos_sin, want_cache, slots, False,
                                         norm_weight, 1e-6)
        want_lat = batched_gemv(q_nope, w_kc.transpose(1, 2), torch.empty(1, H, R, dtype=dtype))
        for got, want in ((got_q, want_q), (cache, want_cache), (got_lat, want_lat)):
            assert torch.equal(got, want), (dtype, (got.float() - want.float()).abs().max().item())
        assert got_lat.is_contiguous()
    try:
        rope_absorb_triton(positions.repeat(2), q_nope.repeat(2, 1, 1), q_pe.repeat(2, 1, 1), kv_c.repeat(2, 1),
                           k_pe.repeat(2, 1), cos_sin, w_kc, cache, slots.repeat(2), False)
    except ValueError as exc:
        assert "takes one token" in str(exc), exc
    else:
        raise AssertionError("two tokens were accepted")
    print("ok")
""")


def test_kernel_matches_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_norm", [False, True])
def test_rope_absorb_is_the_two_launches_in_a_cuda_graph_gpu(kv_norm):
    """V2-Lite's sizes, bf16, behind the q/kv_a GEMV it follows as a programmatic dependent: the fused
    launch, replayed in a CUDA graph, writes the cache and returns the rotated query and the latent
    query bit for bit as the RoPE kernel and the batched GEMV do."""
    from encore.backends.gemv_triton import batched_gemv, gemv
    from encore.backends.rope_cache_triton import rope_absorb_triton, rope_cache_write_triton

    torch.manual_seed(0)
    heads, dn, dr, rank, hidden = 16, 128, 64, 512, 2048
    to = dict(device="cuda", dtype=torch.bfloat16)
    x, w = torch.randn(1, hidden, **to), torch.randn(heads * (dn + dr) + rank + dr, hidden, **to) * 0.02
    w_kc = torch.randn(heads, dn, rank, **to) * 0.05
    norm_weight = (1 + 0.5 * torch.randn(rank, **to)) if kv_norm else None
    cos_sin = torch.randn(4096, dr, device="cuda")
    positions, slots = torch.tensor([3000], device="cuda"), torch.tensor([77], device="cuda")
    caches = [torch.zeros(4, 64, rank + dr, **to) for _ in range(2)]

    def layer(fused: bool):
        qkv = gemv(x, w)
        q = qkv[:, :heads * (dn + dr)].view(1, heads, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        kv_c, k_pe = qkv[:, heads * (dn + dr):-dr], qkv[:, -dr:]
        if fused:
            return rope_absorb_triton(positions, q_nope, q_pe, kv_c, k_pe, cos_sin, w_kc, caches[1], slots, False,
                                      norm_weight, 1e-6)
        q_rot = rope_cache_write_triton(positions, q_pe, kv_c, k_pe, cos_sin, caches[0], slots, False,
                                        norm_weight, 1e-6)
        return q_rot, batched_gemv(q_nope, w_kc.transpose(1, 2), torch.empty(1, heads, rank, **to))

    want = layer(False)
    layer(True)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = layer(True)
    caches[1].zero_()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(caches[1], caches[0])
