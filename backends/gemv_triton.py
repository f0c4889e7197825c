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
token); ``rms_norm_gemv`` is rms_norm(x (+ delta)) · wᵀ, each program normalizing x's rows itself after
its weight preload (the fused norm ops of dense.py and moe.py, which passes/fuse_norms.py puts into a
decode graph), and ``rms_norm`` the same norm alone, one program a row, for more tokens. Limits:
M <= ``MAX_TOKENS``, K <= ``GEMV_MAX_K`` (a program's weight tile holds all of K, at most 16384
elements: 128 a thread on 4 warps), a contiguous last dim of x and of the output, and a weight whose
K (or, batched, N) is contiguous.
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


@triton.jit
def rms_norm_row(x, delta, norm_w, eps, col_ok, SUM, K: tl.constexpr, ADD: tl.constexpr, WRITE_SUM):
    """One row's RMSNorm as ``rms_norm`` computes it, in float32 with x's dtype's roundings: (x + delta)
    rounded to x's dtype (``ADD``; stored at ``SUM`` where ``WRITE_SUM``), normalized, rounded, times
    the weight, rounded. x, delta and norm_w are the row's raw loads (zero past K)."""
    dtype = x.dtype
    if ADD:
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(dtype)
        if WRITE_SUM:
            tl.store(SUM, x, mask=col_ok)
    xf = x.to(tl.float32)
    scaled = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)).to(dtype)
    return (norm_w.to(tl.float32) * scaled.to(tl.float32)).to(dtype).to(tl.float32)


@kernel_variants.watched
@triton.jit(do_not_specialize=["num_tokens", "n", "stride_xm", "stride_xg", "stride_wg", "stride_w", "stride_om",
                               "stride_og", "stride_dm", "stride_sm", "stride_nm", "eps"])
def _gemv_kernel(X, W, OUT, num_tokens, n, stride_xm, stride_xg, stride_wg, stride_w, stride_om, stride_og,
                 DELTA, NORM_W, SUM, NORMED, stride_dm, stride_sm, stride_nm, eps,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CONTIGUOUS: tl.constexpr,
                 BLOCK_M: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, STORE_NORMED: tl.constexpr,
                 ALIGN: tl.constexpr, PDL: tl.constexpr):
    # Program (i, g): rows i·BLOCK_N.. of group g's weight W[g] [N, K]; stride_w is its non-unit stride.
    # NORM (one group): each program normalizes x's rows itself (``rms_norm_row``; ADD: of x + DELTA)
    # before its products; program 0 also stores the sum at SUM (ADD) and the normed rows at NORMED
    # (STORE_NORMED). ALIGN divides every stride of x, W and DELTA (8 where the host found it so, else 1):
    # the strides are not specialized on, and only the hint lets a row's loads be 16-byte vectors (without
    # it each element was a 2-byte load of its own, 166-168 registers a thread against 128).
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < n
    col_ok = cols < K
    if K_CONTIGUOUS:  # [BLOCK_N, BLOCK_K]
        row_start = tl.multiple_of(g * stride_wg + rows * stride_w, ALIGN)
        w = preload_then_wait(W + row_start[:, None] + cols[None, :], row_ok[:, None] & col_ok[None, :], PDL)
    else:  # [BLOCK_K, BLOCK_N]
        col_start = tl.multiple_of(g * stride_wg + cols * stride_w, ALIGN)
        w = preload_then_wait(W + col_start[:, None] + rows[None, :], col_ok[:, None] & row_ok[None, :], PDL)
    tokens = tl.full([1], num_tokens, tl.int32)  # a tensor: the row masks below are tensors (the interpreter's too)
    if NORM:
        norm_w = tl.load(NORM_W + cols, mask=col_ok, other=0.0)
    for m in tl.static_range(BLOCK_M):
        m_ok = m < tokens
        x = tl.load(X + tl.multiple_of(m * stride_xm + g * stride_xg + cols, ALIGN), mask=col_ok & m_ok, other=0.0)
        if NORM:
            delta = x
            if ADD:
                delta = tl.load(DELTA + tl.multiple_of(m * stride_dm + cols, ALIGN), mask=col_ok & m_ok, other=0.0)
            x = rms_norm_row(x, delta, norm_w, eps, col_ok & m_ok, SUM + m * stride_sm + cols, K, ADD,
                             tl.program_id(0) == 0)
            if STORE_NORMED:
                if tl.program_id(0) == 0:
                    tl.store(NORMED + m * stride_nm + cols, x.to(NORMED.dtype.element_ty), mask=col_ok & m_ok)
        else:
            x = x.to(tl.float32)
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
    _check_gemv("gemv", x, w)
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    _launch(x[:, None], w[None], out[:, None], pdl)
    return out


def _check_gemv(name: str, x: torch.Tensor, w: torch.Tensor) -> None:
    if not (gemv_layout(x, w) and 0 < x.shape[0] <= MAX_TOKENS and x.device == w.device):
        raise ValueError(f"{name} takes x [M <= {MAX_TOKENS}, K <= {GEMV_MAX_K}] and w [N, K] of one 16/32-bit "
                         f"dtype and device with contiguous rows; got x {tuple(x.shape)} {x.dtype} stride "
                         f"{x.stride()} on {x.device}, w {tuple(w.shape)} {w.dtype} stride {w.stride()} on {w.device}")


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


def rms_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                  delta: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, keep_normed: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(``dense.rms_norm(x (+ delta), norm_weight, eps)`` · wᵀ [M, N] in ``out_dtype`` (default x's),
    x + delta [M, K] (None without delta), the normed rows [M, K] (None unless ``keep_normed``)),
    M <= MAX_TOKENS: one GEMV launch whose programs each normalize x's rows after their weight
    preload, in place of a norm kernel between the GEMV and the kernel before it."""
    _check_norm(x, norm_weight, delta)
    _check_gemv("rms_norm_gemv", x, w)
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    total = None if delta is None else torch.empty_like(x)
    normed = torch.empty_like(x) if keep_normed else None
    _launch(x[:, None], w[None], out[:, None], True, (norm_weight, eps, delta, total, normed))
    return out, total, normed


def rms_norm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dense.rms_norm(x (+ delta), norm_weight, eps)`` [M, K] and x + delta (None without delta), one
    program a row (``rms_norm_row``): the norm for the rows ``rms_norm_gemv`` does not take."""
    _check_norm(x, norm_weight, delta)
    out = torch.empty_like(x)
    total = None if delta is None else torch.empty_like(x)
    if x.shape[0] == 0:
        return out, total
    ref = delta if delta is not None else x  # stands in for the pointers ADD leaves unread
    total_ref = total if total is not None else out
    pdl = pdl_supported(x.device)
    _rms_norm_kernel[(x.shape[0],)](x, ref, norm_weight, total_ref, out, x.stride(0), ref.stride(0),
                                    total_ref.stride(0), out.stride(0), eps, K=x.shape[1],
                                    BLOCK_K=triton.next_power_of_2(x.shape[1]), ADD=delta is not None,
                                    ALIGN=_align(x.stride(0), ref.stride(0)), PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out, total


@kernel_variants.watched
@triton.jit(do_not_specialize=["stride_xm", "stride_dm", "stride_sm", "stride_om", "eps"])
def _rms_norm_kernel(X, DELTA, NORM_W, SUM, OUT, stride_xm, stride_dm, stride_sm, stride_om, eps,
                     K: tl.constexpr, BLOCK_K: tl.constexpr, ADD: tl.constexpr, ALIGN: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # as Inductor's kernels do: wait before the first read, release the next kernel after the reads
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    x = tl.load(X + tl.multiple_of(m * stride_xm + cols, ALIGN), mask=col_ok, other=0.0)  # ALIGN: as in _gemv_kernel
    delta = x
    if ADD:
        delta = tl.load(DELTA + tl.multiple_of(m * stride_dm + cols, ALIGN), mask=col_ok, other=0.0)
    norm_w = tl.load(NORM_W + cols, mask=col_ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = rms_norm_row(x, delta, norm_w, eps, col_ok, SUM + m * stride_sm + cols, K, ADD, True)
    tl.store(OUT + m * stride_om + cols, y.to(OUT.dtype.element_ty), mask=col_ok)


def _check_norm(x: torch.Tensor, norm_weight: torch.Tensor, delta: torch.Tensor | None) -> None:
    ok = (x.dim() == 2 and x.shape[1] <= GEMV_MAX_K and x.stride(1) == 1 and norm_weight.shape == x.shape[1:]
          and norm_weight.stride(0) == 1 and norm_weight.dtype == x.dtype and norm_weight.device == x.device
          and (delta is None or (delta.shape == x.shape and delta.dtype == x.dtype and delta.stride(1) == 1
                                 and delta.device == x.device)))
    if not ok:
        raise ValueError(f"rms_norm takes x [M, K <= {GEMV_MAX_K}] with contiguous rows, a norm weight [K] and an "
                         f"optional delta like x, of one dtype and device; got x {tuple(x.shape)} {x.dtype} stride "
                         f"{x.stride()}, norm weight {tuple(norm_weight.shape)} {norm_weight.dtype}, delta "
                         f"{None if delta is None else (tuple(delta.shape), delta.dtype, delta.stride())}")


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pdl: bool,
            norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None
            = None) -> None:
    """``norm``: (norm weight, eps, delta, sum out, normed out) for ``rms_norm_gemv`` (one group)."""
    num_tokens, groups, k = x.shape
    n = w.shape[1]
    k_contiguous = w.stride(2) == 1
    block_n, block_k = tile(k, n, k_contiguous)
    pdl = pdl and pdl_supported(x.device)
    norm_weight, eps, delta, total, normed = norm if norm is not None else (None, 0.0, None, None, None)
    flags = dict(NORM=norm is not None, ADD=delta is not None, STORE_NORMED=normed is not None)
    # x stands in for the tensors that NORM, ADD and STORE_NORMED leave unread
    norm_weight, delta, total, normed = (t if t is not None else x[:, 0] for t in (norm_weight, delta, total, normed))
    stride_w = w.stride(1 if k_contiguous else 2)
    align = _align(x.stride(0), x.stride(1), w.stride(0), stride_w, delta.stride(0))
    _gemv_kernel[(triton.cdiv(n, block_n), groups)](
        x, w, out, num_tokens, n, x.stride(0), x.stride(1), w.stride(0), stride_w, out.stride(0), out.stride(1),
        delta, norm_weight, total, normed, delta.stride(0), total.stride(0), normed.stride(0), eps, K=k,
        BLOCK_N=block_n, BLOCK_K=block_k, K_CONTIGUOUS=k_contiguous, BLOCK_M=triton.next_power_of_2(num_tokens),
        **flags, ALIGN=align, PDL=pdl, num_warps=4, launch_pdl=pdl)


def _align(*strides: int) -> int:
    """The ALIGN hint of the kernels here: 8 where every stride their loads add up is a multiple of 8
    elements (then, with an aligned base, a row's loads can be 16-byte vectors), else 1 (no hint)."""
    return 8 if all(s % 8 == 0 for s in strides) else 1


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
