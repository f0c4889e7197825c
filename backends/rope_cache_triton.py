"""Fused RoPE + latent-cache write (the CUDA kernels of ``encore::rope_cache_write`` and, with the
latent query, ``encore::rope_absorb``).

One program per token: rotates the token's shared rope key and writes it, with the compressed kv
(normalized first, given the kv norm's weight: ``gemv_triton.rms_norm_row``), straight into the
token's cache slot (the rotated key never exists as a tensor), and rotates every head's q_pe into a
fresh output. Same math as ``backends.rope.apply_rotary`` (float32, cos/sin from
the table, interleaved pairs written de-interleaved), so it matches the reference to rounding.
One token's latent query (q_nope · W_kc per head) can ride in the same launch
(``rope_absorb_triton``): its GEMV tiles and the RoPE program both read only the q/kv_a projection's
output, so one grid runs them side by side where the RoPE kernel and the absorbed query's GEMV ran one
after the other (a stand-in bs-1 attention chain, H200: 22.61 -> 20.95 µs; benchmarks/README.md).
Runs under Triton's CPU interpreter too (``TRITON_INTERPRET=1``), which is how CI tests it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from encore.backends import kernel_variants
from encore.backends.gemv_triton import preload_then_wait, rms_norm_row, tile
from encore.backends.pdl import pdl_supported


@triton.jit
def _rope_token(t, pos_ptr, slot_ptr, q_ptr, kv_c_ptr, k_pe_ptr, cos_sin_ptr, cache_ptr, q_out_ptr, norm_w_ptr,
                q_stride_t, q_stride_h, kv_c_stride_t, k_pe_stride_t, cos_sin_stride, cache_stride_slot,
                q_out_stride_t, q_out_stride_h, num_heads, eps,
                RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                INTERLEAVED: tl.constexpr, KV_NORM: tl.constexpr):
    """Token t's RoPE + latent-cache write and its q_pe's rotation (the module docstring)."""
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    i = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + i)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + i)
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...
        first = 2 * i
        second = 2 * i + 1
    else:  # halves
        first = i
        second = i + HALF

    dst = cache_ptr + slot * cache_stride_slot
    k1 = tl.load(k_pe_ptr + t * k_pe_stride_t + first).to(tl.float32)
    k2 = tl.load(k_pe_ptr + t * k_pe_stride_t + second).to(tl.float32)
    tl.store(dst + RANK + i, (k1 * cos - k2 * sin).to(cache_ptr.dtype.element_ty))
    tl.store(dst + RANK + HALF + i, (k2 * cos + k1 * sin).to(cache_ptr.dtype.element_ty))
    r = tl.arange(0, BLOCK_RANK)
    latent = tl.load(kv_c_ptr + t * kv_c_stride_t + r, mask=r < RANK, other=0.0)
    if KV_NORM:
        norm_w = tl.load(norm_w_ptr + r, mask=r < RANK, other=0.0)
        latent = rms_norm_row(latent, latent, norm_w, eps, r < RANK, kv_c_ptr, RANK, False, False)
    tl.store(dst + r, latent.to(cache_ptr.dtype.element_ty), mask=r < RANK)

    h = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    heads = h < num_heads
    src = q_ptr + t * q_stride_t + h * q_stride_h
    q1 = tl.load(src + first[None, :], mask=heads).to(tl.float32)  # [BLOCK_HEADS, HALF]
    q2 = tl.load(src + second[None, :], mask=heads).to(tl.float32)
    out = q_out_ptr + t * q_out_stride_t + h * q_out_stride_h
    tl.store(out + i[None, :], (q1 * cos[None, :] - q2 * sin[None, :]).to(q_out_ptr.dtype.element_ty), mask=heads)
    tl.store(out + HALF + i[None, :], (q2 * cos[None, :] + q1 * sin[None, :]).to(q_out_ptr.dtype.element_ty),
             mask=heads)


@kernel_variants.watched
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"],  # views of a step's packed upload
            do_not_specialize=["eps"])
def _rope_cache_write_kernel(
    pos_ptr, slot_ptr, q_ptr, kv_c_ptr, k_pe_ptr, cos_sin_ptr, cache_ptr, q_out_ptr, norm_w_ptr,
    q_stride_t, q_stride_h, kv_c_stride_t, k_pe_stride_t, cos_sin_stride, cache_stride_slot,
    q_out_stride_t, q_out_stride_h, num_heads, eps,
    RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    INTERLEAVED: tl.constexpr, KV_NORM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched as a programmatic dependent: it waits for the kernel before it before reading anything,
        # and a programmatic dependent after it (the absorbed query's GEMV) starts its weight read now
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _rope_token(tl.program_id(0), pos_ptr, slot_ptr, q_ptr, kv_c_ptr, k_pe_ptr, cos_sin_ptr, cache_ptr, q_out_ptr,
                norm_w_ptr, q_stride_t, q_stride_h, kv_c_stride_t, k_pe_stride_t, cos_sin_stride, cache_stride_slot,
                q_out_stride_t, q_out_stride_h, num_heads, eps, RANK, HALF, BLOCK_RANK, BLOCK_HEADS, INTERLEAVED,
                KV_NORM)


@kernel_variants.watched
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"], do_not_specialize=["eps"])
def _rope_absorb_kernel(
    pos_ptr, slot_ptr, q_ptr, kv_c_ptr, k_pe_ptr, cos_sin_ptr, cache_ptr, q_out_ptr, norm_w_ptr,
    q_stride_h, cos_sin_stride, cache_stride_slot, q_out_stride_h, num_heads, eps,
    Q_NOPE, W_KC, Q_LAT, stride_nh, stride_wh, stride_wk, stride_lh,
    RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    INTERLEAVED: tl.constexpr, KV_NORM: tl.constexpr, DN: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ABSORB: tl.constexpr, PDL: tl.constexpr,
):
    # One token. Programs [0, ABSORB): a tile of the latent query, BLOCK_N columns of head h's
    # q_lat[h] = q_nope[h] · W_kc[h] [DN, RANK], its weight read before the wait (as the GEMV's); the
    # last program: the token's RoPE + cache write. Both read only what the kernel before wrote, so
    # they run side by side where the two launches ran one after the other.
    pid = tl.program_id(0)
    if pid < ABSORB:
        blocks = tl.cdiv(RANK, BLOCK_N)
        h = pid // blocks
        cols = (pid % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        w = preload_then_wait(W_KC + h * stride_wh + k[:, None] * stride_wk + cols[None, :],
                              (k[:, None] < DN) & (cols[None, :] < RANK), PDL)  # [BLOCK_K, BLOCK_N]
        x = tl.load(Q_NOPE + h * stride_nh + k, mask=k < DN, other=0.0).to(tl.float32)
        acc = tl.sum(w * x[:, None], axis=0)
        tl.store(Q_LAT + h * stride_lh + cols, acc.to(Q_LAT.dtype.element_ty), mask=cols < RANK)
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        _rope_token(0, pos_ptr, slot_ptr, q_ptr, kv_c_ptr, k_pe_ptr, cos_sin_ptr, cache_ptr, q_out_ptr, norm_w_ptr,
                    0, q_stride_h, 0, 0, cos_sin_stride, cache_stride_slot, 0, q_out_stride_h, num_heads, eps,
                    RANK, HALF, BLOCK_RANK, BLOCK_HEADS, INTERLEAVED, KV_NORM)


def rope_cache_write_triton(positions: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                            cos_sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                            interleaved: bool, kv_norm_weight: torch.Tensor | None = None,
                            eps: float = 0.0) -> torch.Tensor:
    """positions, slot_mapping [T] int64; q_pe [T, H, dr]; kv_c [T, R]; k_pe [T, dr]; cos_sin [P, dr]
    float32; cache [pages, page_size, R + dr] -> rope(q_pe) [T, H, dr] (cache written in place).
    ``kv_norm_weight`` [R] (kv_c's dtype): kv_c is written as ``dense.rms_norm(kv_c, kv_norm_weight, eps)``."""
    _check(positions, q_pe, kv_c, k_pe, cos_sin, cache, slot_mapping, kv_norm_weight)
    num_tokens, num_heads, rope_dim = q_pe.shape
    q_out = torch.empty(num_tokens, num_heads, rope_dim, dtype=q_pe.dtype, device=q_pe.device)
    if num_tokens == 0:
        return q_out
    pdl = pdl_supported(q_pe.device)
    _rope_cache_write_kernel[(num_tokens,)](
        positions, slot_mapping, q_pe, kv_c, k_pe, cos_sin, cache, q_out,
        kv_norm_weight if kv_norm_weight is not None else kv_c,  # stands in for the weight KV_NORM leaves unread
        q_pe.stride(0), q_pe.stride(1), kv_c.stride(0), k_pe.stride(0), cos_sin.stride(0), cache.shape[-1],
        q_out.stride(0), q_out.stride(1), num_heads, eps, **_rope_constants(q_pe, kv_c, interleaved, kv_norm_weight),
        PDL=pdl, launch_pdl=pdl,
    )
    return q_out


def rope_absorb_triton(positions: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                       k_pe: torch.Tensor, cos_sin: torch.Tensor, w_kc: torch.Tensor, cache: torch.Tensor,
                       slot_mapping: torch.Tensor, interleaved: bool, kv_norm_weight: torch.Tensor | None = None,
                       eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's ``rope_cache_write_triton`` and latent query, q_nope [1, H, dn] · W_kc [H, dn, R] per
    head (``dense.absorb_query``), in one launch: (rope(q_pe) [1, H, dr], q_lat [1, H, R] contiguous).
    W_kc's R must be contiguous; the latent query is the batched GEMV's, sum for sum."""
    _check(positions, q_pe, kv_c, k_pe, cos_sin, cache, slot_mapping, kv_norm_weight)
    num_tokens, num_heads, rope_dim = q_pe.shape
    heads, dn, rank = w_kc.shape
    if (num_tokens != 1 or q_nope.shape != (1, num_heads, dn) or heads != num_heads or rank != kv_c.shape[-1]
            or q_nope.stride(-1) != 1 or w_kc.stride(-1) != 1 or len({w_kc.dtype, q_nope.dtype, q_pe.dtype}) != 1):
        raise ValueError(f"rope_absorb_triton takes one token: q_nope [1, H, dn], W_kc [H, dn, R] with R contiguous, "
                         f"of q_pe's dtype; got q_nope {tuple(q_nope.shape)} {q_nope.dtype} stride {q_nope.stride()}, "
                         f"W_kc {tuple(w_kc.shape)} {w_kc.dtype} stride {w_kc.stride()}, q_pe {tuple(q_pe.shape)} "
                         f"{q_pe.dtype}, kv_c {tuple(kv_c.shape)}")
    q_out = torch.empty(1, num_heads, rope_dim, dtype=q_pe.dtype, device=q_pe.device)
    q_lat = torch.empty(1, num_heads, rank, dtype=q_nope.dtype, device=q_nope.device)
    block_n, block_k = tile(dn, rank, k_contiguous=False)  # the batched GEMV's tile of W_kcᵀ
    absorb = num_heads * triton.cdiv(rank, block_n)
    pdl = pdl_supported(q_pe.device)
    _rope_absorb_kernel[(absorb + 1,)](
        positions, slot_mapping, q_pe, kv_c, k_pe, cos_sin, cache, q_out,
        kv_norm_weight if kv_norm_weight is not None else kv_c,
        q_pe.stride(1), cos_sin.stride(0), cache.shape[-1], q_out.stride(1), num_heads, eps,
        q_nope, w_kc, q_lat, q_nope.stride(1), w_kc.stride(0), w_kc.stride(1), q_lat.stride(1),
        **_rope_constants(q_pe, kv_c, interleaved, kv_norm_weight), DN=dn, BLOCK_N=block_n, BLOCK_K=block_k,
        ABSORB=absorb, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return q_out, q_lat


def _rope_constants(q_pe: torch.Tensor, kv_c: torch.Tensor, interleaved: bool,
                    kv_norm_weight: torch.Tensor | None) -> dict:
    rank, (_, num_heads, rope_dim) = kv_c.shape[-1], q_pe.shape
    return dict(RANK=rank, HALF=rope_dim // 2, BLOCK_RANK=triton.next_power_of_2(rank),
                BLOCK_HEADS=triton.next_power_of_2(num_heads), INTERLEAVED=interleaved,
                KV_NORM=kv_norm_weight is not None)


def _check(positions: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
           cos_sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
           kv_norm_weight: torch.Tensor | None) -> None:
    num_tokens, num_heads, rope_dim = q_pe.shape
    rank = kv_c.shape[-1]
    half = rope_dim // 2
    if rope_dim % 2 or half & (half - 1):
        raise ValueError(f"rope dim {rope_dim} must be twice a power of two")
    if k_pe.shape != (num_tokens, rope_dim) or kv_c.shape != (num_tokens, rank):
        raise ValueError(f"k_pe {tuple(k_pe.shape)} / kv_c {tuple(kv_c.shape)} do not match q_pe {tuple(q_pe.shape)}")
    if cache.shape[-1] != rank + rope_dim or not cache.is_contiguous():
        raise ValueError(f"cache {tuple(cache.shape)} must be contiguous with entries of width {rank + rope_dim}")
    if cos_sin.dtype != torch.float32 or cos_sin.shape[-1] != rope_dim or cos_sin.stride(-1) != 1:
        raise ValueError(f"cos_sin must be float32 [positions, {rope_dim}] with unit last stride, got "
                         f"{cos_sin.dtype} {tuple(cos_sin.shape)}")
    for name, tensor in (("positions", positions), ("slot_mapping", slot_mapping)):
        if tensor.shape != (num_tokens,) or tensor.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{num_tokens}], got {tensor.dtype} {tuple(tensor.shape)}")
    for name, tensor in (("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride in its last dimension, got strides {tensor.stride()}")
    if kv_norm_weight is not None and (kv_norm_weight.shape != (rank,) or kv_norm_weight.dtype != kv_c.dtype
                                       or kv_norm_weight.stride(0) != 1):
        raise ValueError(f"kv_norm_weight must be contiguous [{rank}] of kv_c's dtype {kv_c.dtype}, got "
                         f"{kv_norm_weight.dtype} {tuple(kv_norm_weight.shape)} stride {kv_norm_weight.stride()}")
