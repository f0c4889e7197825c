"""encore's Triton kernel for the MHA branch of MLA prefill: ragged causal attention over each row's
decompressed K/V with a cached prefix. A pure function of explicit tensors; a backend plans its arguments.

``mla_prefill`` (FlashAttention-2 forward, ragged, causal with a cached prefix). A program handles
BLOCK_M queries of one row and one head. Programs are numbered over the rows' query tiles in order;
each finds its row with a prefix sum over the per-row tile counts (16 rows at a time), so the
grid, cdiv(Tq, BLOCK_M) + rows per head, depends only on static sizes (no host read of
``qo_indptr``) and wastes no programs on short rows. Head dims that are not a power of two
(192 = 128 + 64) are split into two dots. A kernel rather than flex_attention: flex needs a
BlockMask rebuilt from the indptrs every step and kept in static buffers for capture, where this
kernel takes the indptrs themselves as arguments.

It accumulates in float32 with the exp2 form of the online softmax. Inputs are float32, float16 or
bfloat16 (float32 dots run in IEEE precision, not TF32, so they can match a float32 reference). No
constexpr depends on a step's rows or lengths, and the integers and index tensors that do are not
specialized on, so a step of a new shape compiles nothing (``kernel_variants``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from encore.backends import kernel_variants
from encore.backends.triton_common import (DTYPES, KernelConfig, check, check_last_dim_contiguous,
                                           check_same_device, dot_precision)

_ROW_CHUNK = tl.constexpr(16)  # rows scanned at a time when a program looks for its row


def default_prefill_config(dtype: torch.dtype) -> KernelConfig:
    """Measured on an H100 (kernel time in a CUDA graph, 2026-11-21). 16-bit: 64 queries x 64 keys
    on four warps, ahead of 128 x 64 on eight at every size tried: the V2-Lite shape (H 16, D 192,
    Dv 128) 25 vs 45 us for 64 rows of 20 tokens, 105 vs 127 us for 4 x 1000, 331 vs 379 us for
    1 x 4000. float32 (an exact ``ieee`` dot, no tensor cores): 32 x 32 on four warps, one stage;
    larger tiles spill, and 128 x 64 was 10-25x slower (encore-tiny's H 4, D 96: 7 vs 173 us for 16
    rows of 20 tokens, 89 vs 1070 us for 2 x 500). (64 x 32, four warps, one stage) faults with an
    illegal address in bf16 under Triton 3.6, so it is not a candidate."""
    if dtype == torch.float32:
        return KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    return KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


@kernel_variants.watched
@triton.jit(do_not_specialize=["num_rows"],
            do_not_specialize_on_alignment=["QO_INDPTR", "KV_INDPTR", "PREFIX_LENS"])
def _prefill_kernel(
        Q, K, V, OUT, QO_INDPTR, KV_INDPTR, PREFIX_LENS, qk_scale, num_rows,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        D_A: tl.constexpr, D_B: tl.constexpr, BLOCK_DB: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    # Which row's query tile is this program's: tiles are numbered row after row. The rows are scanned
    # in chunks of _ROW_CHUNK, so that no constexpr depends on the step's row count.
    row = 0  # rows whose tiles all come before this one
    first_tile = 0  # the first tile of row ``row``
    tiles_before = 0
    for r0 in range(0, num_rows, _ROW_CHUNK):
        rows = r0 + tl.arange(0, _ROW_CHUNK)
        in_batch = rows < num_rows
        row_tiles = tl.cdiv(tl.load(QO_INDPTR + rows + 1, mask=in_batch, other=0)
                            - tl.load(QO_INDPTR + rows, mask=in_batch, other=0), BLOCK_M)  # [CHUNK]
        tiles_through = tiles_before + tl.cumsum(row_tiles, 0)
        passed = in_batch & (tiles_through <= tile)
        row += tl.sum(passed.to(tl.int32))
        first_tile = tl.maximum(first_tile, tl.max(tl.where(passed, tiles_through, 0)))
        tiles_before += tl.sum(row_tiles)
    if row >= num_rows:  # the grid is an upper bound on the tile count
        return
    m_tile = tile - first_tile

    q_start = tl.load(QO_INDPTR + row)
    q_count = tl.load(QO_INDPTR + row + 1) - q_start
    kv_start = tl.load(KV_INDPTR + row)
    kv_len = tl.load(KV_INDPTR + row + 1) - kv_start
    prefix = tl.load(PREFIX_LENS + row)
    j = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] query index within the row
    j_ok = j < q_count
    query_pos = prefix + j
    q_tok = (q_start + j).to(tl.int64)

    da = tl.arange(0, D_A)
    db = tl.arange(0, BLOCK_DB)
    dv = tl.arange(0, BLOCK_DV)
    q_row = Q + q_tok[:, None] * stride_qt + head * stride_qh
    q_a = tl.load(q_row + da[None, :], mask=j_ok[:, None], other=0.0)  # [M, D_A]
    if D_B > 0:
        q_b = tl.load(q_row + D_A + db[None, :], mask=j_ok[:, None] & (db[None, :] < D_B), other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Keys past the tile's last query position are invisible to the whole tile: stop there.
    end = tl.minimum(kv_len, prefix + tl.minimum((m_tile + 1) * BLOCK_M, q_count))
    for n0 in range(0, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_tok = (kv_start + n).to(tl.int64)
        k_row = K + kv_tok[:, None] * stride_kt + head * stride_kh
        k_a = tl.load(k_row + da[None, :], mask=n_ok[:, None], other=0.0)  # [N, D_A]
        s = tl.dot(q_a, tl.trans(k_a), input_precision=PRECISION)
        if D_B > 0:
            k_b = tl.load(k_row + D_A + db[None, :], mask=n_ok[:, None] & (db[None, :] < D_B), other=0.0)
            s = tl.dot(q_b, tl.trans(k_b), s, input_precision=PRECISION)
        s = s * qk_scale  # [M, N], log2 units
        s = tl.where(n_ok[None, :] & (n[None, :] <= query_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: keep exp2 NaN-free
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_tok[:, None] * stride_vt + head * stride_vh + dv[None, :],
                    mask=n_ok[:, None] & (dv[None, :] < DV), other=0.0)  # [N, DV]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(OUT + q_tok[:, None] * stride_ot + head * stride_oh + dv[None, :], acc.to(OUT.dtype.element_ty),
             mask=j_ok[:, None] & (dv[None, :] < DV))


def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
                kv_indptr: torch.Tensor, prefix_lens: torch.Tensor, softmax_scale: float, out: torch.Tensor, *,
                config: KernelConfig | None = None) -> torch.Tensor:
    """Ragged causal MHA with a cached prefix, for the prefill rows' decompressed K/V.

    q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv]; row b owns queries qo_indptr[b]:qo_indptr[b+1] and keys
    kv_indptr[b]:kv_indptr[b+1] (its prefix, then its new tokens); query j of row b sits at position
    prefix_lens[b] + j and sees the row's keys 0..that position -> out [Tq, H, Dv]. Index tensors are
    int32; queries no row owns are left untouched. The caller guarantees qo_indptr[-1] <= Tq and
    kv_indptr[-1] <= Tk (checking would read the device). ``config`` None: ``default_prefill_config``.
    """
    check(q.dim() == 3, f"q {tuple(q.shape)}: expected [Tq, H, D]")
    tokens, heads, dim = q.shape
    rows = prefix_lens.shape[0]
    check(q.dtype in DTYPES, f"q dtype {q.dtype} not in {DTYPES}")
    check(k.dtype == v.dtype == q.dtype == out.dtype,
          f"dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}, out {out.dtype}")
    check(k.dim() == 3 and k.shape[1:] == (heads, dim), f"k {tuple(k.shape)}: expected [Tk, {heads}, {dim}]")
    check(v.dim() == 3 and v.shape[:2] == k.shape[:2], f"v {tuple(v.shape)}: expected [{k.shape[0]}, {heads}, Dv]")
    check(out.shape == (tokens, heads, v.shape[2]),
          f"out {tuple(out.shape)}: expected [{tokens}, {heads}, {v.shape[2]}]")
    for name, t, size in (("qo_indptr", qo_indptr, rows + 1), ("kv_indptr", kv_indptr, rows + 1),
                          ("prefix_lens", prefix_lens, rows)):
        check(t.shape == (size,) and t.dtype == torch.int32 and t.is_contiguous(),
              f"{name} {tuple(t.shape)} {t.dtype}: expected contiguous [{size}] int32")
    check(dim >= 16, f"head dim {dim}: must be >= 16")
    check_last_dim_contiguous(q=q, k=k, v=v, out=out)
    check_same_device(q=q, k=k, v=v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, prefix_lens=prefix_lens, out=out)
    if tokens == 0 or rows == 0:
        return out

    config = config or default_prefill_config(q.dtype)
    d_a = 1 << (dim.bit_length() - 1)  # the largest power of two in D; the rest is a second dot
    d_b = dim - d_a
    grid = (triton.cdiv(tokens, config.block_m) + rows, heads)
    _prefill_kernel[grid](
        q, k, v, out, qo_indptr, kv_indptr, prefix_lens, softmax_scale * math.log2(math.e), rows,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        D_A=d_a, D_B=d_b, BLOCK_DB=max(16, triton.next_power_of_2(d_b)), DV=v.shape[2],
        BLOCK_DV=max(16, triton.next_power_of_2(v.shape[2])),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
