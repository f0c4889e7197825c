"""Triton GEMV for the dense projections of a few tokens: the CUDA kernel of ``encore::dense`` (dense.py).

At one to four tokens a projection reads its whole weight to produce a handful of values: its time is
the weight read plus a launch's fixed cost. cuBLAS's kernels at M = 1 take 5-7 µs a projection of
DeepSeek-V2-Lite (8-15 MB of bf16 weight, 2-3.5 µs at copy bandwidth), and in a decode step every
kernel starts only once the one before it has drained.

Each program here owns BLOCK_N weight rows over all of K, loads them into registers first, and only
then waits for the kernel before it (programmatic dependent launch, sm90+: the kernel is launched
with ``launch_pdl`` and calls ``gdc_wait`` before its first read of anything a kernel wrote): the
weight read of a step's next projection overlaps the tail of the kernel it depends on. Then each of
the M token rows is multiplied against the registers (float32 sums) and stored, in a loop unrolled over
BLOCK_M = M rounded up to 1, 2 or 4 (rows past M masked), so that every row's load of x is issued at
once: a loop over M itself read them one after another, and took 0.1-0.2 µs longer a call at one
token on four of V2-Lite's five shapes (0.1 µs less on W_UK) and 0.1-1.4 µs longer at two (H200,
session 31; benchmarks/README.md). Every program waits
before it reads x or stores: nothing written by an earlier kernel is read early, and nothing an
earlier kernel still reads is overwritten. ``gdc_launch_dependents`` right after the weight load lets
the next PDL kernel (another of these) launch and start its own weight read.

``gemv`` is x · wᵀ (``encore::dense`` and the router); ``batched_gemv`` is one such product per group
(MLA's absorbed per-head projections, which the Triton attention backend runs through it at one
token). Limits: M <= ``MAX_TOKENS``, K <= ``GEMV_MAX_K`` (a program's weight tile holds all of K, at
most 16384 elements: 128 a thread on 4 warps), a contiguous last dim of x and of the output, and a
weight whose K (or, batched, N) is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from encore.backends import kernel_variants
from encore.backends.dense import GEMV_MAX_K, gemv_layout
from encore.backends.pdl import pdl_supported

MAX_TOKENS = 4  # rows of x a call takes (each is multiplied against the weight registers in turn)
BLOCK_MS = (1, 2, 4)  # the kernel's row counts (BLOCK_M): M rounded up to a power of two
_MAX_BLOCK_N = 8  # weight rows a program holds when K is contiguous (whole rows of 16-byte vectors)
_MAX_BLOCK_N_COLUMNS = 64  # when N is contiguous: 128 bytes of each of the K rows a program reads


@triton.jit
def preload_then_wait(ptrs, mask, PDL: tl.constexpr):
    """A weight tile (zero outside ``mask``) as float32, loaded before the wait for the kernel before
    (``PDL``): its read overlaps that kernel's tail, and the next programmatic dependent is released
    once it is issued. Nothing a kernel wrote may be read before this returns."""
    w = tl.load(ptrs, mask=mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    return w.to(tl.float32)


@kernel_variants.watched
@triton.jit(do_not_specialize=["num_tokens", "n", "stride_xm", "stride_xg", "stride_wg", "stride_w", "stride_om",
                               "stride_og"])
def _gemv_kernel(X, W, OUT, num_tokens, n, stride_xm, stride_xg, stride_wg, stride_w, stride_om, stride_og,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CONTIGUOUS: tl.constexpr,
                 BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    # Program (i, g): rows i·BLOCK_N.. of group g's weight W[g] [N, K]; stride_w is its non-unit stride.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < n
    col_ok = cols < K
    w_group = W + g * stride_wg
    if K_CONTIGUOUS:  # [BLOCK_N, BLOCK_K]
        w = preload_then_wait(w_group + rows[:, None] * stride_w + cols[None, :], row_ok[:, None] & col_ok[None, :],
                              PDL)
    else:  # [BLOCK_K, BLOCK_N]
        w = preload_then_wait(w_group + cols[:, None] * stride_w + rows[None, :], col_ok[:, None] & row_ok[None, :],
                              PDL)
    tokens = tl.full([1], num_tokens, tl.int32)  # a tensor: the row masks below are tensors (the interpreter's too)
    for m in tl.static_range(BLOCK_M):
        m_ok = m < tokens
        x = tl.load(X + m * stride_xm + g * stride_xg + cols, mask=col_ok & m_ok, other=0.0).to(tl.float32)
        if K_CONTIGUOUS:
            acc = tl.sum(w * x[None, :], axis=1)
        else:
            acc = tl.sum(w * x[:, None], axis=0)
        tl.store(OUT + m * stride_om + g * stride_og + rows, acc.to(OUT.dtype.element_ty), mask=row_ok & m_ok)


def tile(k: int, n: int, k_contiguous: bool = True) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a weight [n, k]: all of k in one tile, as many rows as fit."""
    block_k = triton.next_power_of_2(k)
    most = _MAX_BLOCK_N if k_contiguous else min(_MAX_BLOCK_N_COLUMNS, triton.next_power_of_2(n))
    return max(1, min(most, GEMV_MAX_K // block_k)), block_k


def gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, pdl: bool = True) -> torch.Tensor:
    """x [M, K] · w [N, K]ᵀ -> [M, N] in ``out_dtype`` (default x's), float32 sums, M <= MAX_TOKENS.
    ``pdl``: launch as a programmatic dependent (sm90+); False launches it plainly (bench_small_m.py's
    comparison)."""
    if not (gemv_layout(x, w) and 0 < x.shape[0] <= MAX_TOKENS and x.device == w.device):
        raise ValueError(f"gemv takes x [M <= {MAX_TOKENS}, K <= {GEMV_MAX_K}] and w [N, K] of one 16/32-bit "
                         f"dtype and device with contiguous rows; got x {tuple(x.shape)} {x.dtype} stride "
                         f"{x.stride()} on {x.device}, w {tuple(w.shape)} {w.dtype} stride {w.stride()} on {w.device}")
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    _launch(x[:, None], w[None], out[:, None], pdl)
    return out


def batched_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """out[m, g] = w[g] · x[m, g] for x [M, G, K], w [G, N, K] and out [M, G, N] (written in place, any
    strides but a contiguous last dim), float32 sums, M <= MAX_TOKENS. w's K or its N must be
    contiguous: MLA's absorbed projections per head, W_UV [H, dv, R] (K = R contiguous) and W_UKᵀ
    [H, R, dn] (a view of W_UK [H, dn, R]: N = R contiguous)."""
    ok = (x.dim() == w.dim() == out.dim() == 3 and 0 < x.shape[0] <= MAX_TOKENS and x.shape[1] == w.shape[0]
          and x.shape[2] == w.shape[2] <= GEMV_MAX_K and out.shape == (x.shape[0], w.shape[0], w.shape[1])
          and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.dtype == x.dtype
          and x.stride(2) == out.stride(2) == 1 and 1 in (w.stride(1), w.stride(2))
          and x.device == w.device == out.device)
    if not ok:
        raise ValueError(f"batched_gemv takes x [M <= {MAX_TOKENS}, G, K <= {GEMV_MAX_K}], w [G, N, K] with K or "
                         f"N contiguous and out [M, G, N], x and w of one 16/32-bit dtype, on one device; got x "
                         f"{tuple(x.shape)} {x.dtype} stride {x.stride()}, w {tuple(w.shape)} {w.dtype} stride "
                         f"{w.stride()}, out {tuple(out.shape)} stride {out.stride()}")
    _launch(x, w, out, pdl)
    return out


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    num_tokens, groups, k = x.shape
    n = w.shape[1]
    k_contiguous = w.stride(2) == 1
    block_n, block_k = tile(k, n, k_contiguous)
    pdl = pdl and pdl_supported(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), groups)](
        x, w, out, num_tokens, n, x.stride(0), x.stride(1), w.stride(0), w.stride(1 if k_contiguous else 2),
        out.stride(0), out.stride(1), K=k, BLOCK_N=block_n, BLOCK_K=block_k, K_CONTIGUOUS=k_contiguous,
        BLOCK_M=triton.next_power_of_2(num_tokens), PDL=pdl, num_warps=4, launch_pdl=pdl)


def warm_up(reduction_lengths: set[int], dtype: torch.dtype, device: torch.device) -> None:
    """Compiles the kernel for each reduction length and BLOCK_M, with x's dtype and with float32 out
    (the router)."""
    for k in sorted(reduction_lengths):
        if k > GEMV_MAX_K:
            continue
        w = torch.zeros(1, k, dtype=dtype, device=device)
        for tokens in BLOCK_MS:
            x = torch.zeros(tokens, k, dtype=dtype, device=device)
            for out_dtype in {dtype, torch.float32}:
                gemv(x, w, out_dtype)
