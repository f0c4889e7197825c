"""Triton fused MoE: the CUDA kernel of ``encore::routed_experts`` (see ``moe.FUSED_MOE_MAX_PAIRS``).

Built for decode, where a MoE layer is a batched GEMV over the few experts the tokens chose: the
time is the chosen experts' weight bytes over the memory bandwidth, and every launch or pass over
the weights beyond one shows. The T·k (token, expert) pairs are grouped by expert into blocks of
BLOCK_M and each block runs through two GEMM kernels that read only its expert's weights:

    align   (E programs)                pair p = t·k + j  ->  sorted_pairs[slot], block_expert[block]
    gate_up (max_blocks, cdiv(I, BN))   inter[slot]  = SiLU(x[t]·w13[e, :I]ᵀ) · (x[t]·w13[e, I:]ᵀ)
    down    (max_blocks, cdiv(H, BN))   per_pair[p]  = inter[slot]·w2[e]ᵀ
    sum     (T, cdiv(H, BLOCK_H))       out[t]       = Σ_j weights[t·k + j] · per_pair[t·k + j], j = 0..k-1 in order

One token (decode at batch size 1) skips the alignment: a token's experts are distinct, so there is
nothing to group: gate_up's programs of pair j read expert ids[j] themselves (its fused shared-expert
pairs know theirs) and hold a few rows of its gate and up over all of H, as the GEMV holds a weight
(gemv_triton.py), and every down program reads all the pairs' ids. It has no sum launch
either: each down program computes a block of hidden columns for all k pairs and sums them itself,
so a decode step's MoE is two launches. On sm90+ both launch as programmatic dependents: gate_up
while the routing selection runs (which releases it once its own wait returns), its routed pairs'
programs waiting before they read or write anything and its shared pairs' programs reading x and
their weights first and waiting only before they write; down, which waits at its top, as gate_up's
weight reads end (session 23 had each kernel release the next at its start, and the step got
slower; benchmarks/README.md, "Session 30"). Down releases the kernel after it as its own weight
reads end, before the pair sum and its stores: that kernel must wait before it reads or writes
memory (graphs/compiler.inductor_patches).

Alignment: expert e owns the slots starts[e]..starts[e] + cdiv(count_e, BM)·BM; its pairs fill them
in pair order and the rest hold the sentinel T·k. With at most m = min(E, T·k) experts chosen, the
blocks number at most (T·k + m·(BM - 1)) // BM: both buffers have that static size and no host
reads the counts, so the four launches can be captured in a CUDA graph. Blocks past the real count
have block_expert -1 and their programs return at once (the grid is the bound, not the count). On
sm90+ the four launch as programmatic dependents that wait before they read or write anything, as
one token's down kernel and routed pairs do: align releases gate_up at its start, gate_up and down
release the next kernel as their weight reads end, and the sum releases the kernel after it once it
has read its pairs.

Determinism: every output element is written by exactly one program and the per-token sum over
the k pairs runs in a fixed order, with no atomics, so the result does not depend on scheduling.
Dots and one token's gate_up row sums accumulate in float32 (float32 inputs in IEEE precision, so they
can match a float32 reference); the intermediate and each pair's output are stored in the input dtype,
as the reference computes them, and the sum weights the pairs in float32, as the reference does. At a
16-bit verify step of 256 tokens a V2-Lite layer's per-pair outputs are 8.4 MB that down writes and the
sum reads back (16.8 MB each when they were float32: the layer 5.5 µs slower on an H100;
benchmarks/README.md, "Session 56").
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from encore.backends import kernel_variants
from encore.backends.dense import GEMV_MAX_K
from encore.backends.pdl import pdl_supported
from encore.backends.triton_common import DTYPES, KernelConfig, check, check_same_device, dot_precision

# The alignment reads its pairs _ALIGN_CHUNK at a time unless a config row says otherwise
# (FusedMoEConfig.align_chunk) and fills the spare blocks _ALIGN_FILL slots at a time: constants, not
# functions of T, so no kernel variant per token count (kernel_variants).
_ALIGN_CHUNK = 2048
_ALIGN_FILL = 4096
_ALIGN_WARPS = 8


@dataclasses.dataclass(frozen=True, slots=True)
class FusedMoEConfig:
    """block_m: pairs per block (the alignment's padding unit); block_n: output columns per program
    (the gate_up kernel computes block_n of gate and of up); block_k: the reduction tile. Powers of two
    of at least 16, as ``tl.dot`` needs. align_chunk: pairs the alignment reads at a time (a power of
    two of at least 16): one chunk's worth of work is paid however few pairs there are."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    align_chunk: int = _ALIGN_CHUNK

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "align_chunk"):
            _check_power_of_two(name, getattr(self, name))
        _check_launch(self.num_warps, self.num_stages)


def _check_power_of_two(name: str, value: int, least: int = 16) -> None:
    check(value >= least and not value & (value - 1), f"{name}={value}: must be a power of two >= {least}")


def _check_launch(num_warps: int, num_stages: int) -> None:
    KernelConfig(16, 16, num_warps, num_stages)  # the shared kernel config checks warps and stages by these rules


# (most tokens, config for 16-bit inputs); the first row whose bound holds. Measured for V2-Lite
# (E 64, top-6, H 2048, I 1408, bf16) on an H200 (each row within 3% of the best of a sweep of tile
# sizes, warps and stages at its token counts; bench_moe.py --sweep retunes). One token takes the
# one-token kernels (ONE_TOKEN) unless a config is asked for.
# - T <= 128 (decode): an expert gets few of the T·k pairs (~6 at T = 64), so BM 16, the smallest dot
#   tile, wastes least. BN 64 · BK 128 in three stages (~108 KB of shared memory: two programs per SM).
#   The alignment reads 512 pairs at a time (E 66, k 8, H200: 2.1-2.3 µs from 16 to 512 pairs, 3.0 at
#   1024); larger T reads 2048 (3.7 µs at 2048 pairs, 19 at 16384; 512 pairs at a time took 4.7 and 28).
# - larger T (prefill, float32 tests): more pairs per expert, so larger BM reuses each weight tile for
#   more tokens; BM 128 and 8 warps once the experts hold ~100 pairs each.
_CONFIGS = (
    (128, FusedMoEConfig(block_m=16, block_n=64, block_k=128, num_warps=2, num_stages=3, align_chunk=512)),
    (256, FusedMoEConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (512, FusedMoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)),
    (None, FusedMoEConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
)


def default_config(tokens: int, dtype: torch.dtype) -> FusedMoEConfig:
    """The table's config for ``tokens``; float32 halves block_k so a stage takes the same bytes."""
    config = next(c for bound, c in _CONFIGS if bound is None or tokens <= bound)
    if dtype == torch.float32:
        return dataclasses.replace(config, block_k=max(16, config.block_k // 2))
    return config


@dataclasses.dataclass(frozen=True, slots=True)
class OneTokenConfig:
    """The one-token kernels' tiles, each a few weight rows whole over their reduction in registers (the
    GEMV's tile, gemv_triton.py): gate_n rows of gate (and the same rows of up) per gate_up program,
    down_n hidden rows per down program (of every pair, in turn), at most (fewer where a tile would pass
    GEMV_MAX_K elements); powers of two. num_warps: both kernels'."""

    gate_n: int
    down_n: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        _check_power_of_two("gate_n", self.gate_n, least=1)
        _check_power_of_two("down_n", self.down_n, least=1)
        _check_launch(self.num_warps, 1)  # no stages: the kernels' loops are unrolled


# At V2-Lite (H 2048, I 1408): a gate_up program holds 4 gate and 4 up rows of 2048 (352 programs a pair,
# 127 registers a thread: four programs an SM), a down program 4 hidden rows of 1408 (tiles of 2048) of
# each pair in turn, two pairs' tiles in flight (512 programs, 127 registers; 8 rows: 236, and at V3's
# H 7168 they spill). H200, bench_moe.py --tokens 1 --shared 2: 35.74 µs a layer against 37.46 for the
# tl.dot kernels they replaced, 1.10x the read floor (benchmarks/README.md, "Session 48").
ONE_TOKEN = OneTokenConfig(gate_n=4, down_n=4)


def config_token_counts(max_tokens: int) -> tuple[int, ...]:
    """1 (the one-token kernels), then the fewest tokens above 1 of each row of the config table that a
    step of at most ``max_tokens`` tokens reaches: one forward at each runs every variant of these
    kernels (ModelRunner.warm_up_kernels)."""
    counts, low = [1], 2
    for bound, _ in _CONFIGS:
        if low > max_tokens:
            break
        counts.append(low)
        low = (bound or max_tokens) + 1
    return tuple(counts)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the aligned blocks: each of the at most min(E, pairs) chosen experts pads its
    pairs by fewer than block_m slots."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


@kernel_variants.watched
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"], do_not_specialize_on_alignment=["IDS"])
def _align_kernel(IDS, SORTED, BLOCK_EXPERT, num_pairs, num_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
                  PDL: tl.constexpr):
    # One program per expert: each counts every expert's pairs (the counts place its slots) and then
    # writes only its own slots and blocks, so the programs' stores are disjoint.
    if PDL:  # a programmatic dependent: nothing is read or written before the selection finished; the
        # gate_up kernel (one too) launches now and waits for this one
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    me = tl.program_id(0)
    expert = tl.arange(0, BLOCK_E)  # [E]
    chunk = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, CHUNK):  # a histogram: O(pairs) a program, not O(pairs · E)
        pair = p0 + chunk
        ok = pair < num_pairs
        ids = tl.load(IDS + pair, mask=ok, other=0).to(tl.int32)  # [C]
        counts += tl.histogram(ids, BLOCK_E, mask=ok)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    start = tl.sum(tl.where(expert < me, padded, 0))  # experts in ascending order
    count = tl.sum(tl.where(expert == me, counts, 0))
    my_blocks = tl.cdiv(count, BLOCK_M)

    # My pairs, in pair order: slot = start + how many earlier pairs chose me.
    taken = 0
    for p0 in range(0, num_pairs, CHUNK):
        pair = p0 + chunk
        mine = tl.load(IDS + pair, mask=pair < num_pairs, other=-1) == me  # [C]
        rank = taken + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(SORTED + start + rank, pair.to(tl.int32), mask=mine)
        taken += tl.sum(mine.to(tl.int32))
    # The sentinel in the rest of my last block, and my expert in my blocks.
    row = tl.arange(0, BLOCK_M)
    tl.store(SORTED + start + count + row, tl.full([BLOCK_M], 0, tl.int32) + num_pairs,
             mask=count + row < my_blocks * BLOCK_M)
    blocks = tl.arange(0, FILL)
    for b0 in range(0, my_blocks, FILL):
        tl.store(BLOCK_EXPERT + start // BLOCK_M + b0 + blocks, tl.full([FILL], 0, tl.int32) + me,
                 mask=b0 + blocks < my_blocks)
    # Blocks past the used ones, shared out among the programs: expert -1, every slot the sentinel.
    used = tl.sum(padded) // BLOCK_M
    for b0 in range(used + me * FILL, num_blocks, tl.num_programs(0) * FILL):
        block = b0 + blocks
        tl.store(BLOCK_EXPERT + block, tl.full([FILL], -1, tl.int32), mask=block < num_blocks)
        tl.store(SORTED + block[:, None] * BLOCK_M + row[None, :], tl.full([FILL, BLOCK_M], 0, tl.int32) + num_pairs,
                 mask=block[:, None] < num_blocks)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int, chunk: int = _ALIGN_CHUNK
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, expert) pairs of ``ids`` [T, k] (int64, 0 <= id < E; checking would read the
    device) into per-expert blocks of ``block_m`` -> (sorted_pairs [max_blocks · block_m] int32: pair
    index t·k + j, or the sentinel T·k in padding; block_expert [max_blocks] int32: the block's expert,
    -1 past the used blocks). Experts in ascending order, each one's pairs in pair order. ``chunk``: pairs
    read at a time (FusedMoEConfig.align_chunk)."""
    check(ids.dim() == 2 and ids.dtype == torch.int64 and ids.is_contiguous(),
          f"ids {tuple(ids.shape)} {ids.dtype}: expected contiguous [T, k] int64")
    check(block_m >= 1, f"block_m={block_m}: must be >= 1")
    num_pairs = ids.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    if num_pairs == 0:
        return sorted_pairs, block_expert
    block_e = max(16, triton.next_power_of_2(num_experts))
    fill = max(1, _ALIGN_FILL // block_m)  # spare blocks a store: FILL · BLOCK_M slots
    pdl = pdl_supported(ids.device)
    _align_kernel[(num_experts,)](ids, sorted_pairs, block_expert, num_pairs, blocks, BLOCK_M=block_m,
                                  BLOCK_E=block_e, CHUNK=chunk, FILL=fill, PDL=pdl, num_warps=_ALIGN_WARPS,
                                  launch_pdl=pdl)
    return sorted_pairs, block_expert


@kernel_variants.watched
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(X, W13, SORTED, BLOCK_EXPERT, INTER, num_pairs, stride_xt,
                    TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    # Axis 0 (fastest in launch order) is the block: the blocks of one expert, which read the same
    # weight tile, run together and all but the first find it in L2.
    if PDL:  # a programmatic dependent: nothing is read or written before the alignment finished
        tl.extra.cuda.gdc_wait()
    block = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + block)
    if expert < 0:  # past the used blocks
        return
    slot = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    pair = tl.load(SORTED + slot)
    token = (pair // TOP_K).to(tl.int64)
    row_ok = pair < num_pairs  # padding holds the sentinel
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] columns of gate (and of up, I further)
    n_ok = n < I
    w = W13 + expert.to(tl.int64) * (2 * I * H)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        a = tl.load(X + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [M, K] gathered tokens
        w_gate = tl.load(w + n[:, None] * H + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [N, K]
        w_up = tl.load(w + (I + n[:, None]) * H + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_gate = tl.dot(a, tl.trans(w_gate), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, tl.trans(w_up), acc_up, input_precision=PRECISION)
    if PDL:  # the down kernel (a programmatic dependent) launches as the last programs' weight reads end
        tl.extra.cuda.gdc_launch_dependents()
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # [M, N] SiLU(gate)·up; padding rows are 0
    tl.store(INTER + slot[:, None].to(tl.int64) * I + n[None, :], h.to(INTER.dtype.element_ty),
             mask=n_ok[None, :])


@kernel_variants.watched
@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(INTER, W2, SORTED, BLOCK_EXPERT, PER_PAIR, num_pairs,
                 H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent: nothing is read or written before gate_up finished
        tl.extra.cuda.gdc_wait()
    block = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + block)
    if expert < 0:
        return
    slot = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SORTED + slot)
    row_ok = pair < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] hidden columns
    n_ok = n < H
    w = W2 + expert.to(tl.int64) * (H * I)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        a = tl.load(INTER + slot[:, None].to(tl.int64) * I + k[None, :], mask=k_ok[None, :], other=0.0)  # [M, K]
        w_down = tl.load(w + n[:, None] * I + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [N, K]
        acc = tl.dot(a, tl.trans(w_down), acc, input_precision=PRECISION)
    if PDL:  # the pair sum (a programmatic dependent) launches as the last programs' weight reads end
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(PER_PAIR + pair[:, None].to(tl.int64) * H + n[None, :], acc.to(PER_PAIR.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@kernel_variants.watched
@triton.jit
def _sum_pairs_kernel(PER_PAIR, WEIGHTS, OUT, stride_ot, TOP_K: tl.constexpr, H: tl.constexpr,
                      BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent: nothing is read or written before down finished
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):  # a fixed order: the same sum on every run
        route = tl.load(WEIGHTS + token * TOP_K + j)  # the pair's routing weight, float32
        acc += route * tl.load(PER_PAIR + (token * TOP_K + j) * H + h, mask=h < H, other=0.0).to(tl.float32)
    if PDL:  # the kernel after launches once per_pair is read: fused_moe frees it on return, and the next
        # kernel (Inductor's) may write its memory without waiting, where it neither reads nor writes
        # what this op touched (compiler.inductor_patches)
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(OUT + token * stride_ot + h, acc.to(OUT.dtype.element_ty), mask=h < H)


@kernel_variants.watched
@triton.jit
def _one_token_gate_up_kernel(X, W13, IDS, INTER, H: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, PAIRS: tl.constexpr, ROUTED: tl.constexpr,
                              FIRST_SHARED: tl.constexpr, PDL: tl.constexpr):
    # Program (i, p): rows i·BLOCK_N.. of gate and of up of one pair's expert, each row over all of H in
    # one register tile, as the GEMV holds a weight (gemv_triton.py): its loads are whole 16-byte vectors
    # of contiguous rows and the reduction is in registers. Launch order: the fused shared experts' pairs
    # (ROUTED..) first, the same for every token: as programmatic dependents of the selection, their
    # programs read x and their weights and compute while the selection runs, and wait only before they
    # write. The selection releases this kernel after its own wait, when the kernels before it, x's
    # writer among them, have finished (so x is complete); the routed pairs' programs wait at their top,
    # as they read the selection's ids.
    pair = (tl.program_id(1) + ROUTED) % PAIRS
    routed = pair < ROUTED
    if PDL:
        if routed:
            tl.extra.cuda.gdc_wait()
    expert = tl.where(routed, tl.load(IDS + pair, mask=routed, other=0), FIRST_SHARED - ROUTED + pair.to(tl.int64))
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] rows of gate (and of up, I further)
    k = tl.arange(0, BLOCK_K)
    ok = (n < I)[:, None] & (k < H)[None, :]
    w = W13 + expert * (2 * I * H) + n[:, None] * H + k[None, :]
    w_gate = tl.load(w, mask=ok, other=0.0)  # [N, K]
    w_up = tl.load(w + I * H, mask=ok, other=0.0)
    x = tl.load(X + k, mask=k < H, other=0.0, cache_modifier=".cg").to(tl.float32)  # past L1: read before any wait
    if PDL:  # the down kernel (a programmatic dependent) launches as the weight reads are issued
        tl.extra.cuda.gdc_launch_dependents()
    gate = tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)  # [N]
    up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    if PDL:
        if not routed:  # the selection may still run, reading the router's logits, memory that the
            # route op freed on return and that INTER may reuse
            tl.extra.cuda.gdc_wait()
    h = gate * tl.sigmoid(gate) * up  # SiLU(gate)·up
    tl.store(INTER + pair * I + n, h.to(INTER.dtype.element_ty), mask=n < I)


@kernel_variants.watched
@triton.jit
def _one_token_down_kernel(INTER, W2, IDS, WEIGHTS, OUT, H: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PAIRS: tl.constexpr, PDL: tl.constexpr):
    # Program b: hidden rows b·BLOCK_N.. of the output, so no other program holds a part of its sum. For
    # each pair in turn, its expert's BLOCK_N rows of W2 whole over I in one register tile (the GEMV's,
    # gemv_triton.py) against the pair's intermediate, weighted, added in pair order. The next pair's
    # tile and intermediate are loaded before this pair's products, its expert id a pair earlier still:
    # loaded where it is used, ptxas issued each pair's tile once the pair before had arrived (sm90 SASS;
    # this way two pairs' tiles are out before the first reduction and up to three later).
    if PDL:  # launched as a programmatic dependent: nothing is read or written before gate_up finished
        tl.extra.cuda.gdc_wait()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] hidden rows
    k = tl.arange(0, BLOCK_K)
    rows = n[:, None] * I + k[None, :]
    ok = (n < H)[:, None] & (k < I)[None, :]
    w = tl.load(W2 + tl.load(IDS) * (H * I) + rows, mask=ok, other=0.0)  # [N, K] pair 0's
    a = tl.load(INTER + k, mask=k < I, other=0.0)  # [K]
    expert_next = tl.load(IDS + 1, mask=PAIRS > 1, other=0)
    total = tl.zeros([BLOCK_N], tl.float32)
    for p in tl.static_range(PAIRS):  # pair order, as _sum_pairs_kernel: the same sum on every run
        if p + 1 < PAIRS:
            w_next = tl.load(W2 + expert_next * (H * I) + rows, mask=ok, other=0.0)
            a_next = tl.load(INTER + (p + 1) * I + k, mask=k < I, other=0.0)
            if p + 2 < PAIRS:  # the id a pair ahead, so the tile's addresses wait on no load of their own
                expert_next = tl.load(IDS + p + 2)
        elif PDL:  # the last weight read is issued: the kernel after (the next layer's first GEMV) reads
            # its weight under this one's tail
            tl.extra.cuda.gdc_launch_dependents()
        total += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1) * tl.load(WEIGHTS + p)
        if p + 1 < PAIRS:
            w = w_next
            a = a_next
    tl.store(OUT + n, total.to(OUT.dtype.element_ty), mask=n < H)


def one_token_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  num_shared: int = 0, *, config: OneTokenConfig = ONE_TOKEN) -> torch.Tensor:
    """``fused_moe`` of one token (x [1, H]; inputs as there, checked by it) in two launches."""
    pairs = ids.shape[1]
    inter, hidden = w2.shape[2], x.shape[1]
    intermediate = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # [k, I]
    pdl = pdl_supported(x.device)
    block_h = triton.next_power_of_2(hidden)
    gate_n = max(1, min(config.gate_n, GEMV_MAX_K // (2 * block_h)))  # gate and up rows: one register tile
    _one_token_gate_up_kernel[(triton.cdiv(inter, gate_n), pairs)](
        x, w13, ids, intermediate, H=hidden, I=inter, BLOCK_N=gate_n, BLOCK_K=block_h, PAIRS=pairs,
        ROUTED=pairs - num_shared, FIRST_SHARED=w13.shape[0] - num_shared, PDL=pdl, num_warps=config.num_warps,
        launch_pdl=pdl)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    block_i = triton.next_power_of_2(inter)
    down_n = max(1, min(config.down_n, GEMV_MAX_K // block_i))  # a pair's rows of W2: one register tile
    _one_token_down_kernel[(triton.cdiv(hidden, down_n),)](
        intermediate, w2, ids, weights, out, H=hidden, I=inter, BLOCK_N=down_n, BLOCK_K=block_i, PAIRS=pairs,
        PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl)
    return out


def _sum_pairs(per_pair: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = per_pair [T·k, H] weighted by weights [T, k] and summed over each token's k pairs, in order."""
    tokens, hidden = out.shape
    block_h = min(1024, triton.next_power_of_2(hidden))
    pdl = pdl_supported(out.device)
    _sum_pairs_kernel[(tokens, triton.cdiv(hidden, block_h))](per_pair, weights, out, out.stride(0),
                                                               TOP_K=weights.shape[1], H=hidden, BLOCK_H=block_h,
                                                               PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              num_shared: int = 0, *, config: FusedMoEConfig | None = None) -> torch.Tensor:
    """Routed-expert SwiGLU. x [T, H], w13 [E, 2I, H], w2 [E, H, I] (contiguous, x's dtype), weights
    [T, k] float32, ids [T, k] int64 (0 <= id < E; checking would read the device) -> [T, H] in x's
    dtype. No host reads: capturable in a CUDA graph. ``config`` None: ``one_token_moe`` for one token,
    else the blocked kernels with ``default_config(T, dtype)``. ``num_shared`` = S promises that each
    token's last S pairs are experts E - S..E - 1 with weight 1 (``moe.with_shared_experts``), so one
    token's kernel starts them before the selection ends; the blocked kernels take them as any pair.
    With S > 0 on sm90+, one token's x must be complete when this launches: its shared pairs read x
    before their programmatic wait, which holds right after ``encore::route`` (its selection releases
    this kernel only once its own wait returns), not after a kernel that releases before it writes x."""
    check(x.dim() == 2 and x.stride(1) == 1, f"x {tuple(x.shape)} strides {x.stride()}: expected [T, H], "
          "last dim contiguous")
    tokens, hidden = x.shape
    check(x.dtype in DTYPES, f"x dtype {x.dtype} not in {DTYPES}")
    check(w13.dtype == w2.dtype == x.dtype, f"dtypes differ: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
    check(w13.dim() == 3 and w13.shape[1] % 2 == 0 and w13.shape[2] == hidden and w13.is_contiguous(),
          f"w13 {tuple(w13.shape)}: expected contiguous [E, 2I, {hidden}]")
    experts, inter = w13.shape[0], w13.shape[1] // 2
    check(w2.shape == (experts, hidden, inter) and w2.is_contiguous(),
          f"w2 {tuple(w2.shape)}: expected contiguous [{experts}, {hidden}, {inter}]")
    check(ids.dim() == 2 and ids.shape[0] == tokens and ids.dtype == torch.int64 and ids.is_contiguous(),
          f"ids {tuple(ids.shape)} {ids.dtype}: expected contiguous [{tokens}, k] int64")
    check(weights.shape == ids.shape and weights.dtype == torch.float32 and weights.is_contiguous(),
          f"weights {tuple(weights.shape)} {weights.dtype}: expected contiguous {tuple(ids.shape)} float32")
    check_same_device(x=x, w13=w13, w2=w2, weights=weights, ids=ids)
    top_k = ids.shape[1]
    check(0 <= num_shared < max(top_k, 1) and num_shared <= experts,
          f"num_shared={num_shared}: must be in 0..{max(top_k - 1, 0)} (fewer than the {top_k} pairs a token, "
          f"at most the {experts} experts)")
    out = torch.empty_like(x)
    if tokens == 0 or top_k == 0:
        return out.zero_()
    if config is None and tokens == 1:
        return one_token_moe(x, w13, w2, weights, ids, num_shared)
    config = config or default_config(tokens, x.dtype)
    sorted_pairs, block_expert = align_pairs(ids, experts, config.block_m, config.align_chunk)
    blocks = block_expert.shape[0]
    num_pairs = ids.numel()
    precision = dot_precision(x.dtype)
    pdl = pdl_supported(x.device)
    launch = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, PRECISION=precision,
                  PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)

    intermediate = torch.empty(sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)  # [slots, I]
    _gate_up_kernel[(blocks, triton.cdiv(inter, config.block_n))](
        x, w13, sorted_pairs, block_expert, intermediate, num_pairs, x.stride(0), TOP_K=top_k, H=hidden, I=inter,
        **launch)
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T·k, H], not yet weighted
    _down_kernel[(blocks, triton.cdiv(hidden, config.block_n))](
        intermediate, w2, sorted_pairs, block_expert, per_pair, num_pairs, H=hidden, I=inter, **launch)
    return _sum_pairs(per_pair, weights, out)
