"""The sampler's CUDA kernels: the seeded exponential race of ``sampler.sample_from_probs``, the seeded
uniforms of ``sampler.seeded_uniform`` (speculative acceptance's), and the softmax of few wide rows.

*The race.* A sampled row's token is ``argmax(p / E)`` with ``E = -log(u)`` and ``u`` the counter-based hash
``sampler.seeded_uniform`` of (seed, counter, column, salt). In torch that hash is ~85 elementwise
int64 ops over [N, V] (the 32-bit multiplies split so no int64 product overflows), each a launch: at
bs 1 on DeepSeek-V2-Lite's 102400-wide vocabulary ~260 launches and ~240 µs of GPU time a sampled
step, and the host launching them took longer than the step's forward (H200, session 39: 6-7 ms a
step against 2.1 ms greedy). Here one launch hashes every column in registers in uint32 arithmetic
(whose wrap-around is the reference's ``mod 2**32``), so ``u`` is bit for bit the reference's; the
score divides by ``-log(u)`` rounded as torch rounds (libdevice ``logf``, a correctly rounded divide),
and each program writes its chunk's maximum and the chunk's first column holding it; the argmax over
the chunks picks the first chunk holding the row's maximum. Ties resolve to the lowest column, as
``torch.argmax`` does.

*The uniforms.* The same hash, its ``u`` written out: ``seeded_uniform`` in one launch where torch
takes ~55 (a verify step's acceptance test draws one uniform per draft; inside a stochastic head graph
each of those launches was a node of the replay).

*The softmax.* torch's softmax gives a row one thread block: 35 µs for one 102400-wide row on an H200,
twice in a step that samples with top-p. Here a row is cut into chunks as the race cuts it: one
launch takes each chunk's maximum and its sum of exponentials (online), a second combines the
row's partials in every program and writes its chunk normalized. The sums run in another order than
torch's, and ``tl.exp`` is not libdevice's: probabilities may differ from torch's in their last bits
(a draw changes only where two scores of a row tie to within that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from encore.backends import kernel_variants
from encore.backends.argmax_triton import BLOCK, pick, split

_PROGRAMS = 512  # rows × chunks a launch aims at


@triton.jit
def _mix32(h, S1: tl.constexpr, M1: tl.constexpr, S2: tl.constexpr, M2: tl.constexpr, S3: tl.constexpr):
    h = h ^ (h >> S1)
    h = h * tl.full((), M1, tl.uint32)  # uint32 products wrap: the reference's mod 2**32
    h = h ^ (h >> S2)
    h = h * tl.full((), M2, tl.uint32)
    return h ^ (h >> S3)


@triton.jit
def _murmur3(h):
    return _mix32(h, 16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)


@triton.jit
def _lowbias32(h):
    return _mix32(h, 16, 0x7FEB352D, 15, 0x846CA68B, 16)


@triton.jit
def _absorb(key1, key2, word):
    return _murmur3(key1 ^ word), _lowbias32(key2 ^ word)


@triton.jit
def _row_keys(SEEDS, COUNTERS, row, salt):
    """The two 32-bit keys of ``row``: its seed, then its counter (each the low 32 bits, then the high),
    then the salt, absorbed by both chains."""
    seed = tl.load(SEEDS + row).to(tl.uint64, bitcast=True)
    counter = tl.load(COUNTERS + row).to(tl.uint64, bitcast=True)
    key1 = tl.full((), 0x243F6A88, tl.uint32)
    key2 = tl.full((), 0x13198A2E, tl.uint32)
    key1, key2 = _absorb(key1, key2, seed.to(tl.uint32))
    key1, key2 = _absorb(key1, key2, (seed >> 32).to(tl.uint32))
    key1, key2 = _absorb(key1, key2, counter.to(tl.uint32))
    key1, key2 = _absorb(key1, key2, (counter >> 32).to(tl.uint32))
    return _absorb(key1, key2, salt.to(tl.uint32))


@triton.jit
def _uniform(cols, key1, key2):
    """``u`` of columns ``cols`` under the row keys: the top 23 bits of the keyed hash, (2k + 1) / 2**24."""
    h = _murmur3(_lowbias32(cols.to(tl.uint32) ^ key1) ^ key2)
    return ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@kernel_variants.watched
@triton.jit(do_not_specialize=["SEEDS", "COUNTERS", "OUT", "n", "salt"])
def _uniform_kernel(SEEDS, COUNTERS, OUT, n, salt, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key1, key2 = _row_keys(SEEDS, COUNTERS, row, salt)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + row.to(tl.int64) * n + cols, _uniform(cols, key1, key2), mask=cols < n)


@kernel_variants.watched
@triton.jit(do_not_specialize=["PROBS", "stride", "SEEDS", "COUNTERS", "vocab", "width", "chunks", "salt"])
def _race_kernel(PROBS, stride, SEEDS, COUNTERS, BEST, WHERE, vocab, width, chunks, salt, BLOCK: tl.constexpr,
                 LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    key1, key2 = _row_keys(SEEDS, COUNTERS, row, salt)
    start = chunk * width
    end = tl.minimum(start + width, vocab)
    best = tl.full((), -1.0, tl.float32)
    where = start
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        valid = cols < end
        p = tl.load(PROBS + row.to(tl.int64) * stride + cols, mask=valid, other=0.0).to(tl.float32)
        u = _uniform(cols, key1, key2)
        if LIBDEVICE:  # CUDA's logf, which torch's log calls; the interpreter has no libdevice
            e = -libdevice.log(u)
        else:
            e = -tl.log(u)
        score = tl.where(valid, tl.div_rn(p, e), -1.0)
        top = tl.max(score, axis=0)
        at = offset + tl.argmax(score, axis=0, tie_break_left=True)
        where = tl.where(top > best, at, where)
        best = tl.maximum(top, best)
    tl.store(BEST + row * chunks + chunk, best)
    tl.store(WHERE + row * chunks + chunk, where.to(tl.int64))


@kernel_variants.watched
@triton.jit(do_not_specialize=["X", "stride", "vocab", "width"])
def _softmax_stats_kernel(X, stride, MAX, SUM, FINITE_MIN, vocab, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    start = chunk * width
    end = tl.minimum(start + width, vocab)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    smallest = tl.full((), float("inf"), tl.float32)
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        x = tl.load(X + row.to(tl.int64) * stride + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)  # an all -inf block adds 0, not NaN
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = new_m
        smallest = tl.minimum(smallest, tl.min(tl.where(x > float("-inf"), x, float("inf")), axis=0))
    tl.store(MAX + row * chunks + chunk, m)
    tl.store(SUM + row * chunks + chunk, total)
    tl.store(FINITE_MIN + row * chunks + chunk, smallest)  # the truncation's (backends/truncation_triton.py)


@triton.jit
def _row_max_sum(MAX, SUM, row, chunks, BLOCK_C: tl.constexpr):
    """The row's maximum and sum of ``exp(x - max)``, from its chunks' (-inf and 0 for a row of -inf
    only: its softmax is then NaN, as torch's)."""
    parts = tl.arange(0, BLOCK_C)
    m_parts = tl.load(MAX + row * chunks + parts, mask=parts < chunks, other=float("-inf"))
    m = tl.max(m_parts, axis=0)
    total = tl.sum(tl.load(SUM + row * chunks + parts, mask=parts < chunks, other=0.0)
                   * tl.exp(m_parts - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    return m, total


@kernel_variants.watched
@triton.jit(do_not_specialize=["X", "stride", "OUT", "vocab", "width", "chunks"])
def _softmax_write_kernel(X, stride, MAX, SUM, OUT, vocab, width, chunks, BLOCK: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    m, total = _row_max_sum(MAX, SUM, row, chunks, BLOCK_C)
    start = chunk * width
    end = tl.minimum(start + width, vocab)
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        valid = cols < end
        x = tl.load(X + row.to(tl.int64) * stride + cols, mask=valid, other=0.0).to(tl.float32)
        tl.store(OUT + row.to(tl.int64) * vocab + cols, tl.exp(x - m) / total, mask=valid)


def _chunk_stats(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Each chunk's (maximum, sum of exponentials, smallest finite value) of x [N, V] (N >= 1), and
    (chunks, width)."""
    rows, vocab = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"{name} reads rows of contiguous columns; x has strides {x.stride()}")
    chunks, width = split(rows, vocab, _PROGRAMS)
    # Separate allocations, not views of one: a view's offset would change the pointer's alignment,
    # which Triton specializes on (a variant compiled while serving).
    maxima, sums, finite_minima = (torch.empty(rows, chunks, dtype=torch.float32, device=x.device) for _ in range(3))
    _softmax_stats_kernel[(rows, chunks)](x, x.stride(0), maxima, sums, finite_minima, vocab, width, BLOCK=BLOCK)
    return maxima, sums, finite_minima, chunks, width


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] (rows of contiguous columns) -> softmax over each row, [N, V] float32."""
    rows, vocab = x.shape
    out = torch.empty(rows, vocab, dtype=torch.float32, device=x.device)
    if rows:
        maxima, sums, _, chunks, width = _chunk_stats(x, "softmax_rows")
        _softmax_write_kernel[(rows, chunks)](x, x.stride(0), maxima, sums, out, vocab, width, chunks,
                                              BLOCK=BLOCK, BLOCK_C=_PROGRAMS)  # chunks <= _PROGRAMS
    return out


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, salt: int) -> torch.Tensor:
    """probs [N, V] (any float dtype, rows contiguous), seeds and counters [N] int64 (any stride) -> [N]
    int64, equal to ``argmax(probs.float() / -log(seeded_uniform(seeds, counters, V, salt)))``."""
    rows, vocab = probs.shape
    if probs.stride(1) != 1:
        raise ValueError(f"exponential_race reads rows of contiguous columns; probs has strides {probs.stride()}")
    seeds, counters = seeds.contiguous(), counters.contiguous()  # the kernel reads row r at offset r
    chunks, width = split(rows, vocab, _PROGRAMS)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=probs.device)
    where = torch.empty(rows, chunks, dtype=torch.int64, device=probs.device)
    if rows:
        _race_kernel[(rows, chunks)](probs, probs.stride(0), seeds, counters, best, where, vocab, width, chunks,
                                     salt & 0xFFFFFFFF, BLOCK=BLOCK,
                                     LIBDEVICE=probs.is_cuda)
    return pick(best, where)


def seeded_uniforms(seeds: torch.Tensor, counters: torch.Tensor, n: int, salt: int) -> torch.Tensor:
    """seeds and counters [N] int64 (any stride) -> [N, n] float32, equal to ``seeded_uniform(seeds,
    counters, n, salt)`` bit for bit, in one launch."""
    seeds, counters = seeds.contiguous(), counters.contiguous()  # the kernel reads row r at offset r
    out = torch.empty(seeds.shape[0], n, dtype=torch.float32, device=seeds.device)
    if out.numel():
        _uniform_kernel[(seeds.shape[0], triton.cdiv(n, BLOCK))](
            seeds, counters, out, n, salt & 0xFFFFFFFF, BLOCK=BLOCK)
    return out


def warm_up(vocab: int, device: torch.device) -> None:
    """Compiles each kernel's one variant (nothing they are passed is specialized on: any rows,
    vocabulary, alignment, width or salt run them), so that a first sampled step compiles none."""
    ids = torch.zeros(1, dtype=torch.int64, device=device)
    exponential_race(softmax_rows(torch.zeros(1, vocab, device=device)), ids, ids, 0)
    seeded_uniforms(ids, ids, 1, 0)
