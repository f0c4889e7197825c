"""The seeded exponential race in one kernel: the CUDA path of ``sampler.sample_from_probs``.

A sampled row's token is ``argmax(p / E)`` with ``E = -log(u)`` and ``u`` the counter-based hash
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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from encore.backends import kernel_variants

BLOCK = 1024  # columns a loop iteration
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


@kernel_variants.watched
@triton.jit(do_not_specialize=["PROBS", "stride", "SEEDS", "COUNTERS", "vocab", "width", "chunks", "salt"])
def _race_kernel(PROBS, stride, SEEDS, COUNTERS, BEST, WHERE, vocab, width, chunks, salt, BLOCK: tl.constexpr,
                 LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    seed = tl.load(SEEDS + row).to(tl.uint64, bitcast=True)
    counter = tl.load(COUNTERS + row).to(tl.uint64, bitcast=True)
    key1 = tl.full((), 0x243F6A88, tl.uint32)
    key2 = tl.full((), 0x13198A2E, tl.uint32)
    key1, key2 = _absorb(key1, key2, seed.to(tl.uint32))  # the low 32 bits, then the high
    key1, key2 = _absorb(key1, key2, (seed >> 32).to(tl.uint32))
    key1, key2 = _absorb(key1, key2, counter.to(tl.uint32))
    key1, key2 = _absorb(key1, key2, (counter >> 32).to(tl.uint32))
    key1, key2 = _absorb(key1, key2, salt.to(tl.uint32))
    start = chunk * width
    end = tl.minimum(start + width, vocab)
    best = tl.full((), -1.0, tl.float32)
    where = start
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        valid = cols < end
        p = tl.load(PROBS + row.to(tl.int64) * stride + cols, mask=valid, other=0.0).to(tl.float32)
        h = _murmur3(_lowbias32(cols.to(tl.uint32) ^ key1) ^ key2)
        u = ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
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


def warm_up(vocab: int, device: torch.device) -> None:
    """Compiles the kernel's one variant (nothing it is passed is specialized on: any rows, vocabulary,
    alignment or salt run it), so that a first sampled step does not."""
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    exponential_race(torch.ones(1, vocab, device=device), rows, rows, 0)


def split(rows: int, vocab: int) -> tuple[int, int]:
    """(chunks a row is cut into, columns a chunk): about _PROGRAMS programs, each a whole number of
    BLOCKs."""
    chunks = max(1, min(triton.cdiv(vocab, BLOCK), _PROGRAMS // max(rows, 1)))
    width = triton.cdiv(triton.cdiv(vocab, chunks), BLOCK) * BLOCK
    return triton.cdiv(vocab, width), width


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, salt: int) -> torch.Tensor:
    """probs [N, V] (any float dtype, rows contiguous), seeds and counters [N] int64 -> [N] int64, equal to
    ``argmax(probs.float() / -log(seeded_uniform(seeds, counters, V, salt)))``."""
    rows, vocab = probs.shape
    if probs.stride(1) != 1:
        raise ValueError(f"exponential_race reads rows of contiguous columns; probs has strides {probs.stride()}")
    chunks, width = split(rows, vocab)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=probs.device)
    where = torch.empty(rows, chunks, dtype=torch.int64, device=probs.device)
    if rows:
        _race_kernel[(rows, chunks)](probs, probs.stride(0), seeds, counters, best, where, vocab, width, chunks,
                                     salt & 0xFFFFFFFF, BLOCK=BLOCK,
                                     LIBDEVICE=probs.is_cuda)
    if chunks == 1:
        return where[:, 0]
    return where.gather(1, best.argmax(dim=-1, keepdim=True)).squeeze(1)
