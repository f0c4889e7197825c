"""Top-k and top-p without sorting the vocabulary: each row's threshold found by narrowing brackets.

``sampler.truncated_by_sort`` keeps, per row, the tokens whose logit is >= a threshold ``tau``: the
k-th largest logit for top-k, then for top-p the largest logit whose tokens at or above it hold at
least ``top_p`` of the top-k distribution's mass (its ties kept). In torch that is a sort of the
whole vocabulary, a cumsum and a dozen ops over [rows, vocabulary]: replayed in a CUDA graph on an
H200 at 102400 tokens, 106-115 µs for one row, 330 µs for 8, 920 µs for 64; these kernels take
39-53, 66-81 and 302-330 µs (benchmarks/README.md). The threshold is searched for in two phases
(top-k by counts, then top-p by mass; a row without the filter skips its phase):

- the row's statistics (``sampling_triton._softmax_stats_kernel``: each chunk's maximum, sum of
  exponentials and smallest finite logit);
- two rounds over rows × chunks programs: the current bracket [lo, hi) of logits is cut into NBINS
  bins, each program counts its chunk's logits (and their mass ``exp(x - max)``) at or above every
  bin's lower edge, and the next launch picks the highest bin whose edge still has ``k`` tokens (or
  the target mass) at or above it;
- a compaction of the bracket's logits (each chunk at an offset the counts give: the order, and so
  every sum, is the same on every run);
- one program a row narrows the compacted logits, the bins now spanning the bracket's actual
  smallest and largest logit, until one value is left: the threshold.

Comparisons are on integer keys (a float's bits, negative ones flipped, order the floats'), so every
launch puts a logit in the same bin, and a bracket only ever shrinks. Sums of mass run in another
order than the sort's cumsum: the kept sets differ only where a row's mass at the cut is within
float32 rounding of ``top_p``. Over tens of thousands of kept tokens the cumsum's own error is ~1e-5
of the mass: where they differed on an H200 (14 of 200 flat rows, 2 of 200 peaked ones), each of
the 6 rows checked in float64 sided with these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from encore.backends import kernel_variants
from encore.backends.sampling_triton import _PROGRAMS, _chunk_stats, _row_max_sum

NBINS = 16  # bins a bracket is cut into, each round
TILE = 256  # columns a binning step
_ROUNDS = tl.constexpr(2)  # rounds over the whole row before the compaction
_OPEN = tl.constexpr(2**31 - 1)  # the key above every float's: an unbounded bracket's top


@triton.jit
def _key(x):
    """The order-preserving int32 key of float32 ``x``."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _edges(lo, base, top, top_key, NBINS: tl.constexpr):
    """Lower edges (keys) of NBINS bins of a bracket starting at key ``lo``: the first is ``lo``, the
    others evenly spaced in value from ``base`` towards ``top`` (finite), each past ``lo`` and none
    past ``top_key``, in order."""
    j = tl.arange(0, NBINS)
    spaced = _key(base + j.to(tl.float32) * ((top - base) / NBINS))
    spaced = tl.associative_scan(spaced, 0, _max_combine)  # in order, whatever the rounding
    edges = tl.minimum(tl.maximum(spaced, lo + j), top_key)
    return tl.where(j == 0, lo, edges)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _pick(counts, masses, above_count, above_mass, edges, hi, k, target, BY_COUNT: tl.constexpr,
          NBINS: tl.constexpr):
    """The highest bin whose lower edge has ``k`` tokens (``BY_COUNT``) or ``target`` mass at or above
    it; ``counts``/``masses`` [NBINS] are those of the bracket's tokens at or above each edge.
    Returns that bin's [lo, hi) and the count and mass above it."""
    j = tl.arange(0, NBINS)
    total_count = above_count + counts
    total_mass = above_mass + masses
    if BY_COUNT:
        ok = total_count >= k
    else:
        ok = total_mass >= target
    best = tl.max(tl.where(ok, j, 0), axis=0)  # bin 0 if none qualifies (float rounding only)
    lo = tl.sum(tl.where(j == best, edges, 0), axis=0)
    new_hi = tl.where(best == NBINS - 1, hi, tl.sum(tl.where(j == best + 1, edges, 0), axis=0))
    above_count = tl.where(best == NBINS - 1, above_count, tl.sum(tl.where(j == best + 1, total_count, 0), axis=0))
    above_mass = tl.where(best == NBINS - 1, above_mass, tl.sum(tl.where(j == best + 1, total_mass, 0.0), axis=0))
    return best, lo, new_hi, above_count, above_mass


@triton.jit
def _bin_tile(x, key, inside, m, edges, counts, masses):
    """Adds a tile's logits ``inside`` the bracket to the per-edge counts and masses [TILE, NBINS]."""
    at_or_above = inside[:, None] & (key[:, None] >= edges[None, :])
    counts += at_or_above.to(tl.int32)
    masses += tl.where(at_or_above, tl.exp(x - m)[:, None], 0.0)
    return counts, masses


@triton.jit
def _phase_row(MAXP, SUMP, FMINP, K, P, KTH, ZK, row, vocab, chunks, BY_COUNT: tl.constexpr, TOP_K: tl.constexpr,
               BLOCK_C: tl.constexpr):
    """A row's part in a phase: its maximum, sum of ``exp(x - max)`` and smallest finite logit (from
    the chunks'), whether it runs the phase, its bracket's first key, its k, and its target (k, or the
    mass top-p keeps of the top-k distribution)."""
    m, z = _row_max_sum(MAXP, SUMP, row, chunks, BLOCK_C)
    parts = tl.arange(0, BLOCK_C)
    fmin = tl.min(tl.load(FMINP + row * chunks + parts, mask=parts < chunks, other=float("inf")), axis=0)
    k = tl.load(K + row)
    p = tl.load(P + row)
    if BY_COUNT:
        active = (k > 0) & (k < vocab)
        first = _key(tl.full((), float("-inf"), tl.float32))
        target = 0.0
    else:
        active = p < 1.0
        if TOP_K:
            first = _key(tl.load(KTH + row))
            target = p * tl.load(ZK + row)
        else:
            first = _key(tl.full((), float("-inf"), tl.float32))
            target = p * z
    return m, z, fmin, active, first, k.to(tl.int32), target


@triton.jit
def _tile(X, stride, row, offset, end, TILE: tl.constexpr):
    """Columns ``offset`` .. + TILE of row ``row`` (those before ``end`` valid): (valid, logits, keys)."""
    cols = offset + tl.arange(0, TILE)
    valid = cols < end
    x = tl.load(X + row.to(tl.int64) * stride + cols, mask=valid, other=float("-inf"))
    return valid, x, _key(x)


@triton.jit
def _last_round(EDGES, ABOVE_C, ABOVE_M, PC, PM, record, row, rows, chunks, k, target, BY_COUNT: tl.constexpr,
                NBINS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Picks a bin of round ``record``: from its edges, the counts above them and every chunk's
    per-edge counts. Returns the pick and the chunks' per-edge counts [BLOCK_C, NBINS]."""
    j = tl.arange(0, NBINS)
    parts = tl.arange(0, BLOCK_C)
    at = record * rows + row
    edges = tl.load(EDGES + at * (NBINS + 1) + j)
    hi = tl.load(EDGES + at * (NBINS + 1) + NBINS)
    offsets = (at * chunks + parts[:, None]) * NBINS + j[None, :]
    valid = (parts < chunks)[:, None]
    chunk_counts = tl.load(PC + offsets, mask=valid, other=0)
    masses = tl.sum(tl.load(PM + offsets, mask=valid, other=0.0), axis=0)
    pick = _pick(tl.sum(chunk_counts, axis=0), masses, tl.load(ABOVE_C + at), tl.load(ABOVE_M + at), edges, hi,
                 k, target, BY_COUNT, NBINS)
    return pick, chunk_counts


@kernel_variants.watched
@triton.jit(do_not_specialize=["X", "stride", "K", "P", "vocab", "width", "rows", "chunks"])
def _round_kernel(X, stride, K, P, MAXP, SUMP, FMINP, KTH, ZK, EDGES, ABOVE_C, ABOVE_M, PC, PM, vocab, width,
                  rows, chunks, PHASE: tl.constexpr, ROUND: tl.constexpr, TOP_K: tl.constexpr,
                  NBINS: tl.constexpr, TILE: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    m, z, fmin, active, lo, k, target = _phase_row(MAXP, SUMP, FMINP, K, P, KTH, ZK, row, vocab, chunks, PHASE == 0,
                                                   TOP_K, BLOCK_C)
    if active:
        record = PHASE * _ROUNDS + ROUND
        if ROUND == 0:
            hi = tl.full((), _OPEN, tl.int32)
            above_count = tl.full((), 0, tl.int32)
            above_mass = tl.full((), 0.0, tl.float32)
        else:
            pick, _ = _last_round(EDGES, ABOVE_C, ABOVE_M, PC, PM, record - 1, row, rows, chunks, k, target,
                                  PHASE == 0, NBINS, BLOCK_C)
            _, lo, hi, above_count, above_mass = pick
        top = tl.where(hi == _OPEN, m, tl.minimum(_value(hi), m))
        base = tl.minimum(tl.maximum(_value(lo), fmin), top)  # fmin: -inf logits take no part in spacing
        edges = _edges(lo, base, top, _key(top), NBINS)
        at = record * rows + row
        j = tl.arange(0, NBINS)
        if chunk == 0:
            tl.store(EDGES + at * (NBINS + 1) + j, edges)
            tl.store(EDGES + at * (NBINS + 1) + NBINS, hi)
            tl.store(ABOVE_C + at, above_count)
            tl.store(ABOVE_M + at, above_mass)
        counts = tl.zeros((TILE, NBINS), tl.int32)
        masses = tl.zeros((TILE, NBINS), tl.float32)
        start = chunk * width
        end = tl.minimum(start + width, vocab)
        for offset in range(start, end, TILE):
            valid, x, key = _tile(X, stride, row, offset, end, TILE)
            inside = valid & (key >= lo) & (key < hi)
            if tl.sum(inside.to(tl.int32), axis=0) > 0:  # else skipped
                counts, masses = _bin_tile(x, key, inside, m, edges, counts, masses)
        out = (at * chunks + chunk) * NBINS + j
        tl.store(PC + out, tl.sum(counts, axis=0))
        tl.store(PM + out, tl.sum(masses, axis=0))


@kernel_variants.watched
@triton.jit(do_not_specialize=["X", "stride", "K", "P", "vocab", "width", "rows", "chunks"])
def _compact_kernel(X, stride, K, P, MAXP, SUMP, FMINP, KTH, ZK, EDGES, ABOVE_C, ABOVE_M, PC, PM, OUT, BRACKET,
                    BRACKET_M, vocab, width, rows, chunks, PHASE: tl.constexpr, TOP_K: tl.constexpr,
                    NBINS: tl.constexpr, TILE: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    m, z, fmin, active, lo, k, target = _phase_row(MAXP, SUMP, FMINP, K, P, KTH, ZK, row, vocab, chunks, PHASE == 0,
                                                   TOP_K, BLOCK_C)
    if active:
        pick, chunk_counts = _last_round(EDGES, ABOVE_C, ABOVE_M, PC, PM, PHASE * _ROUNDS + _ROUNDS - 1, row, rows,
                                         chunks, k, target, PHASE == 0, NBINS, BLOCK_C)
        best, lo, hi, above_count, above_mass = pick
        j = tl.arange(0, NBINS)
        # Tokens of each chunk in the picked bin: at or above its lower edge, less those at or above the next.
        inside = (tl.sum(tl.where(j[None, :] == best, chunk_counts, 0), axis=1)
                  - tl.sum(tl.where(j[None, :] == best + 1, chunk_counts, 0), axis=1))  # [BLOCK_C]
        parts = tl.arange(0, BLOCK_C)
        offset = tl.sum(tl.where(parts < chunk, inside, 0), axis=0)
        if chunk == 0:
            at = (PHASE * rows + row) * 4
            tl.store(BRACKET + at, lo)
            tl.store(BRACKET + at + 1, hi)
            tl.store(BRACKET + at + 2, above_count)
            tl.store(BRACKET + at + 3, tl.sum(inside, axis=0))
            tl.store(BRACKET_M + PHASE * rows + row, above_mass)
        start = chunk * width
        end = tl.minimum(start + width, vocab)
        for first in range(start, end, TILE):
            valid, x, key = _tile(X, stride, row, first, end, TILE)
            keep = valid & (key >= lo) & (key < hi)
            slot = offset + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(OUT + row.to(tl.int64) * vocab + slot, x, mask=keep)
            offset += tl.sum(keep.to(tl.int32), axis=0)


@kernel_variants.watched
@triton.jit(do_not_specialize=["K", "P", "vocab", "rows", "chunks"])
def _finish_kernel(K, P, MAXP, SUMP, FMINP, KTH, ZK, TAU, COMPACT, BRACKET, BRACKET_M, vocab, rows, chunks,
                   PHASE: tl.constexpr, TOP_K: tl.constexpr, NBINS: tl.constexpr, TILE: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    m, z, fmin, active, first, k, target = _phase_row(MAXP, SUMP, FMINP, K, P, KTH, ZK, row, vocab, chunks,
                                                      PHASE == 0, TOP_K, BLOCK_C)
    threshold = _value(first)  # a skipped phase: top-k keeps every token, top-p what top-k kept
    kept_mass = z
    if active:
        at = (PHASE * rows + row) * 4
        lo = tl.load(BRACKET + at)
        hi = tl.load(BRACKET + at + 1)
        above_count = tl.load(BRACKET + at + 2)
        n = tl.load(BRACKET + at + 3)
        above_mass = tl.load(BRACKET_M + PHASE * rows + row)
        narrowing = tl.full((), True, tl.int1)
        while narrowing:
            # The bracket's smallest and largest key, smallest finite logit and mass.
            smallest = tl.full((), _OPEN, tl.int32)
            largest = tl.full((), -_OPEN - 1, tl.int32)
            finite = tl.full((), float("inf"), tl.float32)
            mass = tl.full((), 0.0, tl.float32)
            for offset in range(0, n, TILE):
                valid, x, key = _tile(COMPACT, vocab, row, offset, n, TILE)
                inside = valid & (key >= lo) & (key < hi)
                smallest = tl.minimum(smallest, tl.min(tl.where(inside, key, _OPEN), axis=0))
                largest = tl.maximum(largest, tl.max(tl.where(inside, key, -_OPEN - 1), axis=0))
                finite = tl.minimum(finite, tl.min(tl.where(inside & (x > float("-inf")), x, float("inf")), axis=0))
                mass += tl.sum(tl.where(inside, tl.exp(x - m), 0.0), axis=0)
            if smallest >= largest:  # one value left (or, after rounding, none): the threshold
                narrowing = tl.full((), False, tl.int1)
                threshold = tl.where(smallest == _OPEN, _value(lo), _value(smallest))
                kept_mass = above_mass + mass
            else:
                top = _value(largest)
                edges = _edges(smallest, tl.minimum(finite, top), top, largest, NBINS)
                counts = tl.zeros((TILE, NBINS), tl.int32)
                masses = tl.zeros((TILE, NBINS), tl.float32)
                for offset in range(0, n, TILE):
                    valid, x, key = _tile(COMPACT, vocab, row, offset, n, TILE)
                    counts, masses = _bin_tile(x, key, valid & (key >= lo) & (key < hi), m, edges, counts, masses)
                _, lo, hi, above_count, above_mass = _pick(tl.sum(counts, axis=0), tl.sum(masses, axis=0),
                                                           above_count, above_mass, edges, hi, k, target,
                                                           PHASE == 0, NBINS)
    if PHASE == 0:
        tl.store(KTH + row, threshold)
        tl.store(ZK + row, kept_mass)
    else:
        tl.store(TAU + row, threshold)


def truncation_thresholds(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uses_top_k: bool,
                          uses_top_p: bool) -> torch.Tensor:
    """x [N, V] float32 logits (rows of contiguous columns), top_k [N] int64 (<= 0 or >= V: off),
    top_p [N] float32 (>= 1: off) -> [N] float32: each row keeps ``x >= tau``, as
    ``sampler.truncated_by_sort`` would. ``uses_top_k`` / ``uses_top_p``: whether any row may have that
    filter on; a phase no row needs is not launched (its filter is then off in every row)."""
    rows, vocab = x.shape
    if x.dtype != torch.float32:
        raise ValueError(f"truncation_thresholds reads float32 logits; x is {x.dtype}")
    device = x.device
    if not rows or not (uses_top_k or uses_top_p):
        return torch.full((rows,), float("-inf"), device=device)  # every token kept
    maxima, sums, finite_minima, chunks, width = _chunk_stats(x, "truncation_thresholds")
    top_k, top_p = top_k.contiguous(), top_p.contiguous()  # the kernels read row r at offset r
    # Separate allocations, not views of one: a view's offset would change the pointers' alignment,
    # which Triton specializes on (a variant compiled while serving).
    tau, kth, kept_mass = (torch.empty(rows, dtype=torch.float32, device=device) for _ in range(3))
    records = 2 * _ROUNDS.value
    edges = torch.empty(records, rows, NBINS + 1, dtype=torch.int32, device=device)
    above_count = torch.empty(records, rows, dtype=torch.int32, device=device)
    above_mass = torch.empty(records, rows, dtype=torch.float32, device=device)
    counts = torch.empty(records, rows, chunks, NBINS, dtype=torch.int32, device=device)
    masses = torch.empty(records, rows, chunks, NBINS, dtype=torch.float32, device=device)
    compact = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    bracket = torch.empty(2, rows, 4, dtype=torch.int32, device=device)
    bracket_mass = torch.empty(2, rows, dtype=torch.float32, device=device)
    stats = (maxima, sums, finite_minima, kth, kept_mass)
    shape = dict(NBINS=NBINS, TILE=TILE, BLOCK_C=_PROGRAMS)  # chunks <= _PROGRAMS
    for phase in [0] * uses_top_k + [1] * uses_top_p:
        flags = dict(PHASE=phase, TOP_K=uses_top_k, **shape)
        for round_ in range(_ROUNDS.value):
            _round_kernel[(rows, chunks)](x, x.stride(0), top_k, top_p, *stats, edges, above_count, above_mass,
                                          counts, masses, vocab, width, rows, chunks, ROUND=round_, **flags)
        _compact_kernel[(rows, chunks)](x, x.stride(0), top_k, top_p, *stats, edges, above_count, above_mass,
                                        counts, masses, compact, bracket, bracket_mass, vocab, width, rows, chunks,
                                        **flags)
        _finish_kernel[(rows,)](top_k, top_p, *stats, tau, compact, bracket, bracket_mass, vocab, rows, chunks,
                                **flags)
    return tau if uses_top_p else kth  # top-k's phase alone: its threshold


def warm_up(vocab: int, device: torch.device) -> None:
    """Compiles every variant (with and without the top-k phase), so that a first truncated step compiles none."""
    x = torch.zeros(1, vocab, device=device)
    for uses_top_k in (False, True):
        truncation_thresholds(x, torch.ones(1, dtype=torch.int64, device=device),
                              torch.full((1,), 0.5, device=device), uses_top_k, True)
