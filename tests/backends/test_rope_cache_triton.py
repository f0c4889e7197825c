"""The fused RoPE + cache-write Triton kernel against the reference, run by Triton's CPU interpreter
(in a subprocess: TRITON_INTERPRET must be set before Triton compiles anything)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

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
    print("ok")
""")


def test_kernel_matches_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
