"""The CUDA kernels of ``argmax.argmax_rows`` (the greedy pick), and the pick over a row's chunks that
the sampler's exponential race ends with (sampling_triton.py).

torch's ``argmax`` over one 102400-wide bf16 row is a single reduction that runs on few of the GPU's
SMs: 21.7 µs on an H200, where the row is 200 KB. Cut into chunks, with each chunk's maximum and index
taken by one reduction and the argmax over the chunks by a second, the torch version took five
kernels and ~14 µs at one row (H200 profile of a V2-Lite decode step, session 42). On CUDA it is two
Triton launches: ``_chunk_argmax_kernel`` writes every (row, chunk)'s maximum and the first column
holding it, and ``_pick_kernel``, a programmatic dependent released at the first one's start, takes
each row's first chunk holding its maximum.

Ties resolve as ``torch.argmax`` does, to the lowest index. A NaN is the maximum, as in ``argmax``: a
chunk holding one reports NaN at its first NaN's column, and a row's first such chunk wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from encore.backends import kernel_variants
from encore.backends.pdl import pdl_supported

BLOCK = 1024  # columns a loop iteration
MAX_CHUNKS = 512  # chunks a row is cut into at most: the pick kernel's one tile
_PROGRAMS = 2048  # rows × chunks the greedy pick aims at


def split(rows: int, vocab: int, programs: int) -> tuple[int, int]:
    """(chunks a row is cut into, columns a chunk): about ``programs`` programs in all, at most
    MAX_CHUNKS a row, each chunk a whole number of BLOCKs."""
    chunks = max(1, min(triton.cdiv(vocab, BLOCK), programs // max(rows, 1), MAX_CHUNKS))
    width = triton.cdiv(triton.cdiv(vocab, chunks), BLOCK) * BLOCK
    return triton.cdiv(vocab, width), width


@kernel_variants.watched
@triton.jit(do_not_specialize=["stride", "vocab", "width", "chunks"], do_not_specialize_on_alignment=["X"])
def _chunk_argmax_kernel(X, stride, BEST, WHERE, vocab, width, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Program (row, chunk). It reads the logits only once the kernel before has finished, and releases
    # the pick kernel (which waits at its top) right away.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    start = chunk * width
    end = tl.minimum(start + width, vocab)
    best = tl.full((), float("-inf"), tl.float32)
    where = start
    first_nan = end
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        valid = cols < end
        x = tl.load(X + row.to(tl.int64) * stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
        nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, cols, end), axis=0))
        x = tl.where(nan, float("-inf"), x)
        top = tl.max(x, axis=0)
        at = offset + tl.argmax(x, axis=0, tie_break_left=True)
        where = tl.where(top > best, at, where)
        best = tl.maximum(top, best)
    has_nan = first_nan < end
    tl.store(BEST + row * chunks + chunk, tl.where(has_nan, float("nan"), best))
    tl.store(WHERE + row * chunks + chunk, tl.where(has_nan, first_nan, where).to(tl.int64))


@kernel_variants.watched
@triton.jit(do_not_specialize=["chunks"])
def _pick_kernel(BEST, WHERE, OUT, chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    # Row r: the column of its first chunk holding a NaN, else of its first chunk holding the maximum.
    if PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    best = tl.load(BEST + row * chunks + c, mask=c < chunks, other=float("-inf"))
    nan = best != best
    first_nan = tl.min(tl.where(nan, c, BLOCK_C), axis=0)
    top = tl.argmax(tl.where(nan, float("-inf"), best), axis=0, tie_break_left=True)
    chunk = tl.where(first_nan < BLOCK_C, first_nan, top)
    tl.store(OUT + row, tl.load(WHERE + row * chunks + chunk))


def pick(best: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """best [N, C] float32 and where [N, C] int64 (contiguous, C <= MAX_CHUNKS): each row's chunk
    maxima and their columns -> [N] int64, the column of the row's first chunk holding a NaN, else of
    its first chunk holding the maximum."""
    rows, chunks = best.shape
    out = torch.empty(rows, dtype=torch.int64, device=best.device)
    if rows:
        pdl = pdl_supported(best.device)
        _pick_kernel[(rows,)](best, where, out, chunks, BLOCK_C=MAX_CHUNKS, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (rows of contiguous columns, any float dtype) -> [N] int64, equal to
    ``logits.argmax(dim=-1)``, in two launches."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"argmax_triton reads rows of contiguous columns; logits has strides {logits.stride()}")
    chunks, width = split(rows, vocab, _PROGRAMS)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    where = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    if rows:
        pdl = pdl_supported(logits.device)
        _chunk_argmax_kernel[(rows, chunks)](logits, logits.stride(0), best, where, vocab, width, chunks, BLOCK=BLOCK,
                                             PDL=pdl, num_warps=4, launch_pdl=pdl)
    return pick(best, where)


def warm_up(vocab: int, dtypes: set[torch.dtype], device: torch.device) -> None:
    """Compiles the chunk kernel for each logits dtype and the pick kernel (their one variant each:
    no row count, vocabulary, stride or alignment is specialized on)."""
    for dtype in dtypes:
        argmax_triton(torch.zeros(1, vocab, dtype=dtype, device=device))
