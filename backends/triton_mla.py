"""encore's own Triton kernels for MLA decode: the absorbed attention over the paged latent cache. Pure
functions of explicit tensors; a backend plans their arguments (the prefill's MHA branch is
``triton_mla_prefill``).

``mla_decode`` (flash-decoding over the 576-wide latent cache). MLA has one KV head shared by every
query head, so a program takes BLOCK_M (query position, head) pairs of one row — all q_len positions
times a block of heads, flattened as ``i * H + h`` — as the M of its dots, and reads each KV tile
once for all of them: scores = q_lat·kvᵀ + q_pe·k_peᵀ, then acc += p·kv[:, :R] from the same tile
(K is the whole entry, V its first R columns). The keys of a row are cut into ``num_kv_splits``
equal ranges (computed in the kernel from ``seq_lens``, so the grid depends on static shapes only and
the launch can be captured in a CUDA graph); each split writes its normalized partial output and
log-sum-exp to a float32 workspace and a second kernel merges them. A split or query that sees no
key contributes nothing (its output is 0), so splits past a short row's end are harmless. With one
split the first kernel writes ``out`` directly. Given W_vc, a one-token step's merge also projects
the values (latent output · W_vcᵀ per head), as a programmatic dependent of the split kernel whose
W_vc read overlaps it: one launch in place of the merge and ``dense.project_values``'s GEMV.

    grid (cdiv(q_len·H, BLOCK_M), B, num_kv_splits)  then  merge grid (B·q_len, H, column blocks)
                                                      or   merge + values grid (cdiv(dv, rows), H)

It accumulates in float32 with the exp2 form of the online softmax. Inputs are float32, float16 or
bfloat16 (float32 dots run in IEEE precision, not TF32, so they can match a float32 reference).
A decode step's rows and table width pick its launch settings among a few (``decode_configs``: tiles,
stages; one split or several; the merge's column block), which ``warm_up_decode`` compiles at
start-up; beyond those no constexpr depends on a step's rows, lengths or splits, and the integers and
index tensors that do are not specialized on, so a step of a new shape compiles nothing
(``kernel_variants``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from encore.backends import kernel_variants
from encore.backends.dense import project_values, runs_batched_gemv
from encore.backends.gemv_triton import preload_then_wait
from encore.backends.pdl import pdl_supported
from encore.backends.triton_common import (DTYPES, KernelConfig, check, check_last_dim_contiguous,
                                           check_same_device, dot_precision)

MAX_KV_SPLITS = 64
# A split shorter than this costs more in its fixed work (the query load, the merge) than it saves
# (benchmarks/tune_mla_decode.py: bs 1 × 1k keys runs fastest at 32 splits of 32 keys).
MIN_KEYS_PER_SPLIT = 32
# Partial values a merge program loads at once (64 float32 a thread on four warps): all 64 splits of a
# 128-column block in one round (bs 1 × 1k keys with 64 splits, H200: 11.8 -> 9.9 µs a layer for
# split + merge, against 16 splits a round), 16 splits a round of whole 512-wide rows.
_MERGE_TILE = 8192
_MERGE_FEW_ROWS_COLUMNS = 128
# The merge that projects values (``_decode_merge_values_kernel``): W_vc rows a program (32, fewer where
# 32 rows of R would pass _MERGE_VALUES_ELEMENTS) and its warps. Swept on an H200 (bf16, V2-Lite attention,
# one token, a CUDA-graph chain of 26 layers with the W_UK and o_proj GEMVs; 4/8/16/32 rows × 4/8 warps ×
# 8/16/32 splits a round): 32 rows on four warps, 16 splits a round, 15.1 µs a layer at 1k keys and 23.4
# at 8k, against 15.7 / 24.8 with the GEMV's own 8 rows and 17.2 / 25.2 for the merge and GEMV apart.
_MERGE_VALUES_ELEMENTS = 16384
_MERGE_VALUES_ROWS = 32
_MERGE_VALUES_WARPS = 4


SMALL_DECODE = KernelConfig(block_m=16, block_n=32, num_warps=4, num_stages=3)
# The small tile on eight warps, for one row of at most 16 pairs whose splits hold one key tile each
# (16-bit): on four warps (one a scheduler) each warp ran ~1,570 instructions at ~5.6 cycles apiece, the
# split kernel's whole time (Nsight Compute, V2-Lite bs 1 × 1k, H200); on eight each runs ~1,100 and a
# scheduler has two to pick from. With five tiles a split (bs 1 × 8k) eight warps were slower.
ONE_ROW_DECODE = dataclasses.replace(SMALL_DECODE, num_warps=8)
_FLOAT32_WIDE = KernelConfig(block_m=32, block_n=64, num_warps=8, num_stages=3)
# Software pipelining: Triton double-buffers the KV loop from num_stages 5 on (the page-table load
# ahead of the KV load takes the stages below that: at 3 the next tile's copy is issued after this
# tile's dots, at 5 it is in flight during them). It pays once a split has this many keys; shorter
# splits lose the prologue (tune_mla_decode.py, H200: bs 64 × 8k 228 -> 198 µs, bs 1 × 1k 13.4 -> 14.8).
PIPELINE_MIN_KEYS = 192
PIPELINED_STAGES = 5


def _tiles(pairs: int, dtype: torch.dtype) -> list[KernelConfig]:
    """The tiles ``decode_launch`` chooses between for rows of ``pairs`` (position, head) pairs: the
    small one first, then (16-bit, more than 16 pairs) the wide one."""
    if dtype == torch.float32:
        return [SMALL_DECODE if pairs <= 16 else _FLOAT32_WIDE]
    if pairs <= 16:
        return [SMALL_DECODE]
    return [SMALL_DECODE, KernelConfig(block_m=32 if pairs <= 32 else 64, block_n=64, num_warps=8, num_stages=3)]


def _pipelined(config: KernelConfig, dtype: torch.dtype) -> KernelConfig | None:
    """``config`` at PIPELINED_STAGES where its two KV buffers fit the shared memory (16-bit, up to 32
    pairs: 64 × 64 tiles leave no room for the second), else None."""
    if dtype == torch.float32 or config.block_m > 32:
        return None
    return dataclasses.replace(config, num_stages=PIPELINED_STAGES)


def _one_row(pairs: int, dtype: torch.dtype) -> KernelConfig | None:
    """``ONE_ROW_DECODE`` where a row of ``pairs`` (position, head) pairs may take it (16-bit, one head
    block of the small tile), else None; ``decode_launch`` gives it to one row whose splits hold one tile."""
    return ONE_ROW_DECODE if pairs <= SMALL_DECODE.block_m and dtype != torch.float32 else None


def decode_configs(num_heads: int, q_len: int, dtype: torch.dtype) -> list[KernelConfig]:
    """Every launch setting ``decode_launch`` can pick for rows of ``q_len`` tokens (the warm-up
    compiles each, ``warm_up_decode``)."""
    tiles = _tiles(q_len * num_heads, dtype)
    variants = [_pipelined(t, dtype) for t in tiles] + [_one_row(q_len * num_heads, dtype)]
    return tiles + [v for v in variants if v is not None]


def decode_launch(batch: int, num_heads: int, q_len: int, max_seq_len: int, num_sms: int,
                  dtype: torch.dtype) -> tuple[int, KernelConfig]:
    """(KV splits, launch settings) for a decode step, measured on an H200 (benchmarks/tune_mla_decode.py,
    bf16, H 16, R 512, q_len 1/2/4 × bs 1/8/64 × 1k/8k keys). 16-bit:

    - 16 (position, head) pairs per program, 32 keys a tile, four warps (a [16, 512] float32
      accumulator fits their registers), when a row has no more pairs or when even the wide tile's
      grid, split to 64 keys, would not fill the SMs: then latency rules and small programs win
      (bs 1 × q_len 4 × 1k: 13.8 µs against 20.6 with 64 pairs).
    - else 32 pairs (q_len·H ≤ 32) or 64 pairs (more) per program, 64 keys a tile, eight warps; at
      64 pairs the dots are Hopper warpgroup MMAs (bs 64 × q_len 4 × 8k: 577 -> 331 µs against 32 pairs).
    - num_stages PIPELINED_STAGES where a split has PIPELINE_MIN_KEYS keys or more and the buffers fit
      the shared memory (``_pipelined``).
    - one row of at most 16 pairs whose splits hold one tile each: the small tile on eight warps
      (``ONE_ROW_DECODE``; the engine's bs-1 step, V2-Lite × 1k: −21 µs, × 8k, five tiles a split:
      +16 µs, so not there; benchmarks/README.md "Session 52").

    float32 (exact ``ieee`` dots on CUDA cores; tests and the tiny model): 16 × 32 on four warps for
    up to 16 pairs, else 32 × 64 on eight, unpipelined; not tuned."""
    pairs = q_len * num_heads
    tiles = _tiles(pairs, dtype)
    config = tiles[-1]
    if batch * triton.cdiv(pairs, config.block_m) * triton.cdiv(max_seq_len, config.block_n) < num_sms:
        config = tiles[0]  # the wide tile's grid would not fill the SMs
    splits = choose_num_kv_splits(batch, num_heads, q_len, max_seq_len, num_sms, config)
    pipelined = _pipelined(config, dtype)
    if pipelined is not None and triton.cdiv(max_seq_len, splits) >= PIPELINE_MIN_KEYS:
        config = pipelined
    elif batch == 1 and _one_row(pairs, dtype) is not None and triton.cdiv(max_seq_len, splits) <= config.block_n:
        config = ONE_ROW_DECODE  # with the splits chosen for the four-warp tile
    return splits, config


def decode_r_chunk(config: KernelConfig, block_r: int) -> int:
    """Latent columns a chunk of the split kernel's tiles (``_decode_split_kernel``): a quarter of the
    (power-of-two) rank, at least 16 (tl.dot's least), on the MMAs of tiles of up to 32 pairs; whole rows
    at 64 pairs, whose dots are Hopper warpgroup MMAs (issued asynchronously, not a chain a warp waits
    on; in quarters, ptxas gives the tile 368 bytes of stack against 200 whole)."""
    return block_r if config.block_m >= 64 else max(16, block_r // 4)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the Triton interpreter has no SMs; 8 keeps split-KV exercised on the CPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_kv_splits(batch: int, num_heads: int, q_len: int, max_seq_len: int, num_sms: int,
                         config: KernelConfig) -> int:
    """Splits per row so that a decode grid smaller than the GPU fills it once at the programs an SM
    holds (two of four warps, one of eight: measured, e.g. bs 64 × 1k at four warps 38.9 µs with 4
    splits against 47.8 with 8 and 44.9 with 2), each split keeping at least max(MIN_KEYS_PER_SPLIT,
    block_n) keys of a ``max_seq_len`` row; a grid that fills the GPU is not split. Host-side:
    ``max_seq_len`` is a bound the caller knows without reading the device (e.g. the page table's
    width times the page size)."""
    programs = batch * triton.cdiv(q_len * num_heads, config.block_m)
    capacity = num_sms * (2 if config.num_warps <= 4 else 1)
    by_occupancy = max(1, capacity // programs)
    by_length = triton.cdiv(max_seq_len, max(MIN_KEYS_PER_SPLIT, config.block_n))
    return max(1, min(by_occupancy, by_length, MAX_KV_SPLITS))


@triton.jit
def _split_keys(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys each split of a row of ``seq_len`` keys covers: equal ranges rounded to whole tiles (later
    splits of a short row may be empty)."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _load_chunk(rows, rows_ok, c: tl.constexpr, R: tl.constexpr, R_CHUNK: tl.constexpr):
    """Latent columns c·R_CHUNK.. of the rows whose first elements ``rows`` [X] point at: [X, R_CHUNK],
    zeros past R (a chunk wholly past R reads nothing, and the helpers below skip its work)."""
    cols = c * R_CHUNK + tl.arange(0, R_CHUNK)
    if c * R_CHUNK < R:
        return tl.load(rows[:, None] + cols[None, :], mask=rows_ok[:, None] & (cols[None, :] < R), other=0.0)
    return tl.zeros([rows.shape[0], R_CHUNK], rows.dtype.element_ty)


@triton.jit
def _chunk_scores(q, k, scale, c: tl.constexpr, R: tl.constexpr, R_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk c's share of the scores, q [M, R_CHUNK] · k [N, R_CHUNK]ᵀ · scale. The product by the scale
    keeps Triton from folding a sum of these into one dot's accumulator: each chunk's MMAs form a chain
    of their own."""
    if c * R_CHUNK < R:
        return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    return tl.zeros([q.shape[0], k.shape[0]], tl.float32)


@triton.jit
def _chunk_values(acc, p, kv, alpha, c: tl.constexpr, R: tl.constexpr, R_CHUNK: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Chunk c's accumulator [M, R_CHUNK] rescaled by alpha [M] plus p [M, N] · kv [N, R_CHUNK]."""
    if c * R_CHUNK < R:
        return tl.dot(p, kv, acc * alpha[:, None], input_precision=PRECISION)
    return acc


@triton.jit
def _store_chunk(rows, rows_ok, value, c: tl.constexpr, R: tl.constexpr, R_CHUNK: tl.constexpr):
    """``_load_chunk``'s columns of ``rows`` := value, in the rows' dtype."""
    if c * R_CHUNK < R:
        cols = c * R_CHUNK + tl.arange(0, R_CHUNK)
        tl.store(rows[:, None] + cols[None, :], value.to(rows.dtype.element_ty),
                 mask=rows_ok[:, None] & (cols[None, :] < R))


@kernel_variants.watched
@triton.jit(do_not_specialize=["stride_ptb", "num_splits"], do_not_specialize_on_alignment=["PAGE_TABLE", "SEQ_LENS"])
def _decode_split_kernel(
        Q, QPE, KV, PAGE_TABLE, SEQ_LENS, OUT, PART_O, PART_LSE, qk_scale,
        stride_qt, stride_qh, stride_pet, stride_peh, stride_kvp, stride_kvs, stride_ptb, stride_ot, stride_oh,
        num_splits, NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, PAGE_SIZE: tl.constexpr,
        R: tl.constexpr, DR: tl.constexpr, R_CHUNK: tl.constexpr, BLOCK_DR: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
        RELEASE: tl.constexpr, DEPENDENT: tl.constexpr):
    # Head blocks vary fastest in the launch order, so the programs that read the same KV tiles run
    # together and all but the first find them in L2. The latent columns are (up to) four chunks of
    # R_CHUNK, each its own query, key, score and accumulator tile: on the MMAs of a small tile one
    # [M, R] · [R, N] dot is a chain of R / 16 dependent MMAs a warp (32 at R 512, the longest wait of a
    # key tile), four chunks' scores are four chains side by side (``decode_r_chunk``).
    if RELEASE:  # the merge launched as a programmatic dependent starts its weight read now
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] flat (position i, head h) = i * H + h
    b = tl.program_id(1)
    split = tl.program_id(2)
    pair_ok = pair < Q_LEN * NUM_HEADS
    qi = pair // NUM_HEADS
    head = pair % NUM_HEADS
    tok = (b * Q_LEN + qi).to(tl.int64)  # [M] token index into q / out
    seq_len = tl.load(SEQ_LENS + b)
    query_pos = seq_len - Q_LEN + qi  # [M] query i sees keys 0..query_pos

    split_len = _split_keys(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if DEPENDENT:  # launched as a programmatic dependent (``tables_ready``): the row's length and its first
        # tile's pages are read under the kernel before, which wrote the queries and this step's key
        first = start + tl.arange(0, BLOCK_N)
        first_pages = tl.load(PAGE_TABLE + b * stride_ptb + first // PAGE_SIZE, mask=first < end, other=0)
        tl.extra.cuda.gdc_wait()

    d = tl.arange(0, BLOCK_DR)
    q_rows = Q + tok * stride_qt + head * stride_qh  # [M]
    q0 = _load_chunk(q_rows, pair_ok, 0, R, R_CHUNK)  # [M, R_CHUNK]
    q1 = _load_chunk(q_rows, pair_ok, 1, R, R_CHUNK)
    q2 = _load_chunk(q_rows, pair_ok, 2, R, R_CHUNK)
    q3 = _load_chunk(q_rows, pair_ok, 3, R, R_CHUNK)
    q_pe = tl.load(QPE + tok[:, None] * stride_pet + head[:, None] * stride_peh + d[None, :],
                   mask=pair_ok[:, None] & (d[None, :] < DR), other=0.0)  # [M, DR]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, R_CHUNK], tl.float32)
    acc1 = tl.zeros([BLOCK_M, R_CHUNK], tl.float32)
    acc2 = tl.zeros([BLOCK_M, R_CHUNK], tl.float32)
    acc3 = tl.zeros([BLOCK_M, R_CHUNK], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [N] key positions
        n_ok = n < end
        if DEPENDENT:
            later = n0 > start
            page = tl.where(later, tl.load(PAGE_TABLE + b * stride_ptb + n // PAGE_SIZE, mask=n_ok & later, other=0),
                            first_pages)
        else:
            page = tl.load(PAGE_TABLE + b * stride_ptb + n // PAGE_SIZE, mask=n_ok, other=0)
        entry = KV + page.to(tl.int64) * stride_kvp + (n % PAGE_SIZE) * stride_kvs  # [N] latent entries
        kv0 = _load_chunk(entry, n_ok, 0, R, R_CHUNK)  # [N, R_CHUNK]
        kv1 = _load_chunk(entry, n_ok, 1, R, R_CHUNK)
        kv2 = _load_chunk(entry, n_ok, 2, R, R_CHUNK)
        kv3 = _load_chunk(entry, n_ok, 3, R, R_CHUNK)
        k_pe = tl.load(entry[:, None] + R + d[None, :], mask=n_ok[:, None] & (d[None, :] < DR), other=0.0)
        s = ((_chunk_scores(q0, kv0, qk_scale, 0, R, R_CHUNK, PRECISION)
              + _chunk_scores(q1, kv1, qk_scale, 1, R, R_CHUNK, PRECISION))
             + (_chunk_scores(q2, kv2, qk_scale, 2, R, R_CHUNK, PRECISION)
                + _chunk_scores(q3, kv3, qk_scale, 3, R, R_CHUNK, PRECISION))
             + _chunk_scores(q_pe, k_pe, qk_scale, 0, DR, BLOCK_DR, PRECISION))  # [M, N], log2 units
        s = tl.where(n_ok[None, :] & (n[None, :] <= query_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A query with no visible key yet keeps m = -inf; subtracting 0 instead keeps exp2 free of NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(kv0.dtype)
        acc0 = _chunk_values(acc0, p, kv0, alpha, 0, R, R_CHUNK, PRECISION)  # [M, R_CHUNK]
        acc1 = _chunk_values(acc1, p, kv1, alpha, 1, R, R_CHUNK, PRECISION)
        acc2 = _chunk_values(acc2, p, kv2, alpha, 2, R, R_CHUNK, PRECISION)
        acc3 = _chunk_values(acc3, p, kv3, alpha, 3, R, R_CHUNK, PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)  # [M]: a query that saw no key stores 0
    if DIRECT:
        rows = OUT + tok * stride_ot + head * stride_oh  # [M]
    else:
        part = (tok * NUM_HEADS + head) * num_splits + split  # [M] row of the [T, H, S] workspace
        rows = PART_O + part * R
        tl.store(PART_LSE + part, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=pair_ok)
    _store_chunk(rows, pair_ok, acc0 / l_safe[:, None], 0, R, R_CHUNK)
    _store_chunk(rows, pair_ok, acc1 / l_safe[:, None], 1, R, R_CHUNK)
    _store_chunk(rows, pair_ok, acc2 / l_safe[:, None], 2, R, R_CHUNK)
    _store_chunk(rows, pair_ok, acc3 / l_safe[:, None], 3, R, R_CHUNK)


@triton.jit
def _merged(PART_O, PART_LSE, base, seq_len, num_splits, c, c_ok, R: tl.constexpr, SPLIT_N: tl.constexpr,
            BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """The merged latent output [C] (float32) of columns ``c`` of the (token, head) whose splits' rows
    start at ``base``, in a row of ``seq_len`` keys split ``num_splits`` ways in tiles of SPLIT_N keys,
    loading CHUNK_S splits' slices at a time. Only the splits that hold keys are read; which ones is
    known from the row's length, so their slices are read together with the log-sum-exps (a mask on
    the weights would wait for those first)."""
    split_len = _split_keys(seq_len, num_splits, SPLIT_N)
    splits = tl.cdiv(seq_len, tl.maximum(split_len, 1))  # the first ones, each holding keys
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(PART_LSE + base + s, mask=s < splits, other=float("-inf"))  # [S], log2 units
    lse_max = tl.max(lse, 0)
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.sum(tl.exp2(lse - lse_ref), 0)  # a split no key of the query's reached weighs 0
    acc = tl.zeros([BLOCK_C], tl.float32)
    for s0 in range(0, splits, CHUNK_S):
        k = s0 + tl.arange(0, CHUNK_S)
        part = tl.load(PART_O + (base + k)[:, None] * R + c[None, :], mask=(k < splits)[:, None] & c_ok[None, :],
                       other=0.0)  # [K, C]
        weight = tl.exp2(tl.load(PART_LSE + base + k, mask=k < splits, other=float("-inf")) - lse_ref)  # [K]
        acc += tl.sum(part * weight[:, None], 0)
    return acc / tl.where(total > 0.0, total, 1.0)


@kernel_variants.watched
@triton.jit(do_not_specialize=["num_splits", "q_len"], do_not_specialize_on_alignment=["SEQ_LENS"])
def _decode_merge_kernel(PART_O, PART_LSE, SEQ_LENS, OUT, stride_ot, stride_oh, num_splits, q_len,
                         NUM_HEADS: tl.constexpr, R: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_S: tl.constexpr,
                         CHUNK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # One program per (token, head, BLOCK_C latent columns), loading CHUNK_S splits' slices at a time: up
    # to CHUNK_S splits merge in one round of loads (a loop over single splits was ~8 µs per layer at
    # bs 1 × 34 splits, longer than the split kernel itself), and column blocks give a one-row step
    # programs enough to spread its loads over the SMs (and, narrower, more splits a round).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # [C] latent columns
    seq_len = tl.load(SEQ_LENS + tok // q_len)
    acc = _merged(PART_O, PART_LSE, (tok * NUM_HEADS + head) * num_splits, seq_len, num_splits, c, c < R, R, SPLIT_N,
                  BLOCK_S, CHUNK_S, BLOCK_C)
    tl.store(OUT + tok * stride_ot + head * stride_oh + c, acc.to(OUT.dtype.element_ty), mask=c < R)


@kernel_variants.watched
@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["SEQ_LENS"])
def _decode_merge_values_kernel(PART_O, PART_LSE, SEQ_LENS, W, OUT, num_splits, stride_wh, stride_wn, stride_oh,
                                R: tl.constexpr, DV: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_R: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
                                PDL: tl.constexpr):
    # One token. Program (i, h): rows i·BLOCK_N.. of head h's W_vc [DV, R]. The weight is read into
    # registers first (as a programmatic dependent: while the split kernel runs), then the token's merged
    # latent of head h, rounded to the model's dtype as the unmerged path stores it, is multiplied against
    # it: the GEMV of ``dense.project_values`` with the merge as its prologue. Every program of a head
    # merges the head's splits itself (no second launch, no latent output in memory). The row's length is
    # read before the wait too: the split kernel releases this one at its start, and it began either
    # plainly, once whatever wrote the length had finished, or (``tables_ready``) as a dependent of a
    # kernel that releases it only once everything before that kernel had finished.
    seq_len = tl.load(SEQ_LENS)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    head = tl.program_id(1)
    c = tl.arange(0, BLOCK_R)
    c_ok = c < R
    row_ok = rows < DV
    w = preload_then_wait(W + head * stride_wh + rows[:, None] * stride_wn + c[None, :],
                          row_ok[:, None] & c_ok[None, :], PDL)
    o = _merged(PART_O, PART_LSE, head * num_splits, seq_len, num_splits, c, c_ok, R, SPLIT_N, BLOCK_S, CHUNK_S,
                BLOCK_R)
    o = o.to(W.dtype.element_ty).to(tl.float32)
    acc = tl.sum(w * o[None, :], axis=1)
    tl.store(OUT + head * stride_oh + rows, acc.to(OUT.dtype.element_ty), mask=row_ok)


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
               seq_lens: torch.Tensor, q_len: int, softmax_scale: float, out: torch.Tensor, *,
               w_vc: torch.Tensor | None = None, num_kv_splits: int | None = None,
               config: KernelConfig | None = None, tables_ready: bool = False) -> torch.Tensor:
    """Absorbed MLA decode of B rows of ``q_len`` tokens each over the paged latent cache.

    q_lat [B·q_len, H, R] (q_nope·W_kc), q_pe [B·q_len, H, Dr], kv_cache [pages, page_size, R + Dr],
    page_table [B, max_pages] int32, seq_lens [B] int32 (KV length after this step, the q_len new
    tokens included) -> out [B·q_len, H, R] (the latent output, before ·W_vc); with ``w_vc`` [H, dv, R]
    out [B·q_len, H, dv] is the values, the latent output · W_vcᵀ per head (``dense.project_values``).
    At one token, where that projection runs on the GEMV and the keys are split, the merge kernel does
    it: its programs merge a head's splits and multiply the result against their rows of W_vc, one
    launch for both (``_decode_merge_values_kernel``); elsewhere the latent output goes through a
    temporary and ``dense.project_values`` (the batched GEMV up to ``dense.BATCHED_GEMV_TOKENS``).
    Query i of row b sits at position seq_lens[b] - q_len + i and sees keys 0..that position; the
    caller guarantees seq_lens[b] <= max_pages·page_size. ``config`` and ``num_kv_splits`` None: chosen
    from the SM count and the page table's capacity (``decode_launch``, or ``choose_num_kv_splits`` for
    a given config: static, so a captured graph stays valid for any seq_lens).
    ``tables_ready``: ``seq_lens`` and ``page_table`` were complete before the kernel launched last began,
    and that kernel releases its programmatic dependents only after its own wait (the one-token RoPE +
    absorb kernel, ``rope_cache_triton``): the split kernel then launches as its dependent and reads the
    row's length and first pages before it waits (sm90+).
    """
    check(q_lat.dim() == 3, f"q_lat {tuple(q_lat.shape)}: expected [B·q_len, H, R]")
    tokens, heads, rank = q_lat.shape
    check(q_len >= 1 and tokens % q_len == 0, f"q_len={q_len} does not divide the {tokens} query tokens")
    batch = tokens // q_len
    check(q_lat.dtype in DTYPES, f"q_lat dtype {q_lat.dtype} not in {DTYPES}")
    check(q_pe.dtype == q_lat.dtype == kv_cache.dtype == out.dtype,
          f"dtypes differ: q_lat {q_lat.dtype}, q_pe {q_pe.dtype}, kv_cache {kv_cache.dtype}, out {out.dtype}")
    check(q_pe.dim() == 3 and q_pe.shape[:2] == (tokens, heads),
          f"q_pe {tuple(q_pe.shape)}: expected [{tokens}, {heads}, Dr] like q_lat {tuple(q_lat.shape)}")
    rope = q_pe.shape[2]
    check(kv_cache.dim() == 3 and kv_cache.shape[2] == rank + rope,
          f"kv_cache {tuple(kv_cache.shape)}: expected [pages, page_size, {rank} + {rope}]")
    if w_vc is None:
        check(out.shape == q_lat.shape, f"out {tuple(out.shape)} must match q_lat {tuple(q_lat.shape)}")
    else:
        check(w_vc.dim() == 3 and w_vc.shape[0] == heads and w_vc.shape[2] == rank and w_vc.dtype == q_lat.dtype,
              f"w_vc {tuple(w_vc.shape)} {w_vc.dtype}: expected [{heads}, dv, {rank}] {q_lat.dtype}")
        check(out.shape == (tokens, heads, w_vc.shape[1]),
              f"out {tuple(out.shape)}: expected [{tokens}, {heads}, {w_vc.shape[1]}] (w_vc's dv)")
        check_last_dim_contiguous(w_vc=w_vc)
        check_same_device(q_lat=q_lat, w_vc=w_vc)
    check(page_table.dim() == 2 and page_table.shape[0] == batch and page_table.dtype == torch.int32,
          f"page_table {tuple(page_table.shape)} {page_table.dtype}: expected [{batch}, max_pages] int32")
    check(page_table.stride(1) == 1, f"page_table stride {page_table.stride()}: rows must be contiguous")
    check(seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
          f"seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}: expected contiguous [{batch}] int32")
    check_last_dim_contiguous(q_lat=q_lat, q_pe=q_pe, kv_cache=kv_cache, out=out)
    check_same_device(q_lat=q_lat, q_pe=q_pe, kv_cache=kv_cache, page_table=page_table, seq_lens=seq_lens, out=out)
    page_size = kv_cache.shape[1]
    max_seq_len, num_sms = page_table.shape[1] * page_size, _num_sms(q_lat.device)
    if config is None:
        splits, config = decode_launch(batch, heads, q_len, max_seq_len, num_sms, q_lat.dtype)
        num_kv_splits = splits if num_kv_splits is None else num_kv_splits
    elif num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(batch, heads, q_len, max_seq_len, num_sms, config)
    check(1 <= num_kv_splits <= MAX_KV_SPLITS, f"num_kv_splits={num_kv_splits}: allowed 1..{MAX_KV_SPLITS}")
    if tokens == 0:
        return out

    direct = num_kv_splits == 1
    merge_values = w_vc is not None and not direct and tokens == 1 and runs_batched_gemv(tokens, w_vc)
    # The latent output: out itself, or a temporary in q_lat's layout (merge_values: none is written)
    latent = out if w_vc is None or merge_values else torch.empty_like(q_lat)
    if direct:  # the split kernel writes the latent output itself; the workspace arguments are never read
        part_o = part_lse = latent
    else:
        part_o = torch.empty(tokens, heads, num_kv_splits, rank, dtype=torch.float32, device=out.device)
        part_lse = torch.empty(tokens, heads, num_kv_splits, dtype=torch.float32, device=out.device)
    sm90 = pdl_supported(out.device)
    pdl, dependent = merge_values and sm90, tables_ready and sm90
    block_r = max(16, triton.next_power_of_2(rank))
    grid = (triton.cdiv(q_len * heads, config.block_m), batch, num_kv_splits)
    _decode_split_kernel[grid](
        q_lat, q_pe, kv_cache, page_table, seq_lens, latent, part_o, part_lse, softmax_scale * math.log2(math.e),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        page_table.stride(0), latent.stride(0), latent.stride(1), num_kv_splits,
        NUM_HEADS=heads, Q_LEN=q_len, PAGE_SIZE=page_size, R=rank, DR=rope, R_CHUNK=decode_r_chunk(config, block_r),
        BLOCK_DR=max(16, triton.next_power_of_2(rope)), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        DIRECT=direct, PRECISION=dot_precision(q_lat.dtype), RELEASE=pdl, DEPENDENT=dependent,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=dependent)
    block_s = triton.next_power_of_2(MAX_KV_SPLITS)
    if merge_values:
        block_n = max(1, min(_MERGE_VALUES_ROWS, _MERGE_VALUES_ELEMENTS // block_r))
        _decode_merge_values_kernel[(triton.cdiv(w_vc.shape[1], block_n), heads)](
            part_o, part_lse, seq_lens, w_vc, out, num_kv_splits, w_vc.stride(0), w_vc.stride(1), out.stride(1),
            R=rank, DV=w_vc.shape[1], SPLIT_N=config.block_n, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_S=block_s,
            CHUNK_S=min(block_s, _MERGE_TILE // block_r), PDL=pdl, num_warps=_MERGE_VALUES_WARPS, launch_pdl=pdl)
        return out
    if not direct:
        block_c = _merge_columns(tokens, heads, num_sms, block_r)
        _decode_merge_kernel[(tokens, heads, triton.cdiv(rank, block_c))](
            part_o, part_lse, seq_lens, latent, latent.stride(0), latent.stride(1), num_kv_splits, q_len,
            NUM_HEADS=heads, R=rank, SPLIT_N=config.block_n, BLOCK_S=block_s,
            CHUNK_S=min(block_s, _MERGE_TILE // block_c), BLOCK_C=block_c, num_warps=4)
    if w_vc is not None:
        project_values(latent, w_vc, out)
    return out


def _merge_columns(tokens: int, heads: int, num_sms: int, block_r: int) -> int:
    """Latent columns per merge program: whole rows once the (token, head) pairs alone fill the SMs,
    else 128 so that a one-row step spreads its merge over more programs. 128 everywhere was slower
    at many rows (H200, decode + merge, bs 64 × 1k: q_len 1 51.1 against 39.2 µs, q_len 4 116 against
    71 µs; two machines whose flashinfer times agreed within 3 %)."""
    return block_r if tokens * heads >= num_sms else min(block_r, _MERGE_FEW_ROWS_COLUMNS)


def warm_up_decode(cache: torch.Tensor, page: int, num_heads: int, q_len: int, rope: int, v_head_dim: int,
                   softmax_scale: float) -> int:
    """Launches ``mla_decode`` once per kernel variant a step with rows of ``q_len`` tokens can reach
    (each ``decode_configs`` entry, with one split and with several, each merge width, the merge that
    projects values, one token's split kernel as a dependent) on scratch queries over ``page`` of
    ``cache`` (contents unused), laid out as the Triton backend lays out its own (q_lat head-major,
    values through a W_vc of ``v_head_dim`` rows a head); returns the launches. Variants compiled here
    are not compiled while serving."""
    rank, page_size = cache.shape[2] - rope, cache.shape[1]
    width = triton.cdiv(q_len, page_size)
    w_vc = torch.zeros(num_heads, v_head_dim, rank, dtype=cache.dtype, device=cache.device)
    launches = 0
    for rows in sorted({1, triton.cdiv(_num_sms(cache.device), q_len * num_heads)}):  # both merge widths
        tokens = rows * q_len
        q_lat = torch.zeros(num_heads, tokens, rank, dtype=cache.dtype, device=cache.device).transpose(0, 1)
        q_pe = torch.zeros(tokens, num_heads, rope, dtype=cache.dtype, device=cache.device)
        table = torch.full((rows, width), page, dtype=torch.int32, device=cache.device)
        seq_lens = torch.full((rows,), q_len, dtype=torch.int32, device=cache.device)
        out = torch.empty(tokens, num_heads, v_head_dim, dtype=cache.dtype, device=cache.device)
        # one token: also as a dependent (``tables_ready``), where a launch can be one (sm90+)
        readiness = (False, True) if tokens == 1 and pdl_supported(cache.device) else (False,)
        for config in decode_configs(num_heads, q_len, cache.dtype):
            for splits in (1, 2):
                for ready in readiness:
                    mla_decode(q_lat, q_pe, cache, table, seq_lens, q_len, softmax_scale, out, w_vc=w_vc,
                               num_kv_splits=splits, config=config, tables_ready=ready)
                    launches += 1
    return launches
