"""encore's Triton MLA kernels against float32 torch references.

Without CUDA the kernels run in Triton's interpreter (``triton_interpreter.py``: why it must be enabled
before triton is imported, and the child process that runs these tests when it could not be), in
float32 and float16; bfloat16 is covered by the GPU tests (``-m gpu``), which use the real sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_interpreter import in_process, rerun_in_child  # before anything imports triton

from encore.backends import triton_mla
from encore.backends.dense import project_values
from encore.backends.triton_common import KernelConfig
from encore.backends.triton_mla import (
    MAX_KV_SPLITS, choose_num_kv_splits, decode_configs, decode_launch, mla_decode, warm_up_decode)
from encore.backends.triton_mla_prefill import mla_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---------------------------------------------------------------- references (float32, one row at a time)

def decode_reference(q_lat, q_pe, kv_cache, page_table, seq_lens, q_len, scale):
    """[B·q, H, R]: each query attends to its row's keys 0..position, read page by page."""
    rank = q_lat.shape[-1]
    out = torch.zeros(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    for b, length in enumerate(seq_lens.tolist()):
        keys = kv_cache[page_table[b].long()].flatten(0, 1)[:length].float()  # [L, R + Dr]
        for i in range(q_len):
            t = b * q_len + i
            visible = keys[:length - q_len + i + 1]
            if visible.shape[0] == 0:
                continue
            q = torch.cat([q_lat[t], q_pe[t]], dim=-1).float()  # [H, R + Dr]
            out[t] = torch.softmax(q @ visible.T * scale, dim=-1) @ visible[:, :rank]
    return out


def prefill_reference(q, k, v, qo_indptr, kv_indptr, prefix_lens, scale):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    for b in range(prefix_lens.shape[0]):
        q0, q1 = qo_indptr[b].item(), qo_indptr[b + 1].item()
        k0, k1 = kv_indptr[b].item(), kv_indptr[b + 1].item()
        if q1 == q0:
            continue
        query_pos = prefix_lens[b].item() + torch.arange(q1 - q0, device=q.device)
        mask = torch.arange(k1 - k0, device=q.device)[None, :] <= query_pos[:, None]  # [n, S]
        qh, kh, vh = (t.float().transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))  # [H, *, D]
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


def max_rel_error(out, ref):
    """Largest per-token relative Frobenius error (a row that is all zero counts absolute error)."""
    diff = (out.float() - ref).flatten(1).norm(dim=1)
    return (diff / ref.flatten(1).norm(dim=1).clamp_min(1.0)).max().item()


# ---------------------------------------------------------------- inputs

def make_decode(seq_lens, q_len, heads, rank, rope, page_size, dtype, spare_pages=2, seed=0):
    """Random queries and a paged cache whose pages are shuffled; every cache slot no row owns (the
    rest of a row's last page, unused pages, the page table's spare columns) is NaN, so a kernel that
    reads past a row's end fails the comparison."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    pages_per_row = [-(-n // page_size) for n in seq_lens]
    max_pages = max(pages_per_row) + spare_pages
    num_pages = sum(pages_per_row) + 1  # the last page is the NaN page the spare columns point to
    cache = torch.full((num_pages, page_size, rank + rope), float("nan"))
    order = torch.randperm(num_pages - 1, generator=gen).tolist()
    page_table = torch.full((batch, max_pages), num_pages - 1, dtype=torch.int32)
    for b, length in enumerate(seq_lens):
        owned = [order.pop() for _ in range(pages_per_row[b])]
        page_table[b, :len(owned)] = torch.tensor(owned, dtype=torch.int32)
        flat = cache[owned].flatten(0, 1)  # [pages·page_size, R + Dr] (a copy: written back below)
        flat[:length] = torch.randn(length, rank + rope, generator=gen)
        cache[owned] = flat.view(len(owned), page_size, rank + rope)
    # q_lat and q_pe are views of one packed query, as a fused projection produces them.
    packed = torch.randn(batch * q_len, heads, rank + rope, generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    packed, cache = packed.to(**to), cache.to(**to)
    return (packed[..., :rank], packed[..., rank:], cache, page_table.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


def indptr(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)


def make_prefill(rows, heads, dim, dim_v, dtype, seed=0):
    """rows: (prefix length, new tokens) per row; K/V hold each row's prefix and new tokens."""
    gen = torch.Generator().manual_seed(seed)
    new = [n for _, n in rows]
    kv_lens = [p + n for p, n in rows]
    to = dict(device=DEVICE, dtype=dtype)
    q = torch.randn(sum(new), heads, dim, generator=gen).to(**to)
    k = torch.randn(sum(kv_lens), heads, dim, generator=gen).to(**to)
    v = torch.randn(sum(kv_lens), heads, dim_v, generator=gen).to(**to)
    meta = [indptr(new), indptr(kv_lens), torch.tensor([p for p, _ in rows], dtype=torch.int32)]
    return (q, k, v, *(t.to(DEVICE) for t in meta))


# ---------------------------------------------------------------- decode (CPU: interpreter)

@in_process
@pytest.mark.parametrize("num_kv_splits", [1, 3, 37, None])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_decode_matches_reference(q_len, page_size, num_kv_splits, config=None):
    # seq_len == q_len: the whole context is this step's tokens, and with 3 splits two are empty.
    # 37 splits, most of them empty: rows this narrow merge all of them in one round.
    seq_lens = [q_len, q_len + 5, 37, 70]
    heads, rank, rope, scale = 6, 32, 16, 0.3
    q_lat, q_pe, cache, page_table, lens = make_decode(seq_lens, q_len, heads, rank, rope, page_size, torch.float32)
    out = torch.full(q_lat.shape, float("nan"), device=DEVICE)
    mla_decode(q_lat, q_pe, cache, page_table, lens, q_len, scale, out, num_kv_splits=num_kv_splits, config=config)
    ref = decode_reference(q_lat, q_pe, cache, page_table, lens, q_len, scale)
    assert max_rel_error(out, ref) < 1e-5


@in_process
@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_small_tiles_several_head_blocks(q_len, num_kv_splits):
    # 16 (position, head) pairs per program: 6 heads x 3 positions spill into a second, partial block.
    test_decode_matches_reference(q_len, 4, num_kv_splits, config=SMALL)


@in_process
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_float16_and_strided_out(num_kv_splits):
    q_len, heads, rank, rope, scale = 2, 16, 64, 16, 0.125
    q_lat, q_pe, cache, page_table, lens = make_decode([3, 50, 130], q_len, heads, rank, rope, 16, torch.float16)
    wide = torch.zeros(q_lat.shape[0], heads, rank + 8, dtype=torch.float16, device=DEVICE)
    out = wide[..., :rank]  # a strided output (rows rank + 8 apart)
    mla_decode(q_lat, q_pe, cache, page_table, lens, q_len, scale, out, num_kv_splits=num_kv_splits)
    ref = decode_reference(q_lat, q_pe, cache, page_table, lens, q_len, scale)
    assert max_rel_error(out, ref) < 2e-3
    assert (wide[..., rank:] == 0).all()


@in_process
@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_decode_query_without_keys_writes_zeros(num_kv_splits):
    q_lat, q_pe, cache, page_table, lens = make_decode([0, 9], 1, 4, 32, 16, 4, torch.float32)
    out = torch.full(q_lat.shape, float("nan"), device=DEVICE)
    mla_decode(q_lat, q_pe, cache, page_table, lens, 1, 0.2, out, num_kv_splits=num_kv_splits)
    assert (out[0] == 0).all()
    assert max_rel_error(out, decode_reference(q_lat, q_pe, cache, page_table, lens, 1, 0.2)) < 1e-5


def test_choose_num_kv_splits():
    # Many rows fill the GPU without splitting; one long row splits up to the cap; a short one by length
    # (32 keys a split at least, block_n if more); a grid short of the SMs splits to fill them once, at
    # two programs an SM for four warps and one for eight.
    small, wide = KernelConfig(16, 32, 4, 3), KernelConfig(64, 64, 8, 3)
    assert choose_num_kv_splits(batch=512, num_heads=16, q_len=1, max_seq_len=8192, num_sms=132, config=small) == 1
    assert choose_num_kv_splits(batch=1, num_heads=16, q_len=1, max_seq_len=65536, num_sms=132,
                                config=small) == MAX_KV_SPLITS
    assert choose_num_kv_splits(batch=1, num_heads=16, q_len=1, max_seq_len=300, num_sms=132, config=small) == 10
    assert choose_num_kv_splits(batch=1, num_heads=16, q_len=1, max_seq_len=300, num_sms=132, config=wide) == 5
    assert choose_num_kv_splits(batch=64, num_heads=16, q_len=1, max_seq_len=1088, num_sms=132, config=small) == 4
    assert choose_num_kv_splits(batch=8, num_heads=16, q_len=4, max_seq_len=8256, num_sms=132, config=wide) == 16
    assert choose_num_kv_splits(batch=64, num_heads=16, q_len=4, max_seq_len=8256, num_sms=132, config=wide) == 2


@pytest.mark.parametrize(("batch", "q_len", "max_seq_len", "want"), [
    (1, 1, 1088, (16, 32, 8, 3)),  # one row, 34 splits of one tile: eight warps
    (1, 1, 2048, (16, 32, 8, 3)),  # 64 splits of one tile
    (1, 1, 2112, (16, 32, 4, 3)),  # 64 splits of 33 keys, two tiles: four warps
    (1, 1, 8256, (16, 32, 4, 3)),  # 64 splits of 129 keys
    (1, 1, 16448, (16, 32, 4, 5)),  # 64 splits of 257 keys: pipelined
    (2, 1, 1088, (16, 32, 4, 3)),
    (64, 1, 1088, (16, 32, 4, 5)),  # 4 splits of 272 keys: pipelined
    (8, 1, 8256, (16, 32, 4, 5)),
    (1, 4, 1088, (16, 32, 4, 3)),  # the wide tile's grid would not fill the SMs
    (8, 4, 1088, (64, 64, 8, 3)),  # warpgroup MMAs; 64 x 64 buffers leave no room for a second stage
    (64, 2, 1088, (32, 64, 8, 5)),
    (8, 2, 1088, (32, 64, 8, 3)),  # 16 splits of 68 keys
])
def test_decode_launch(batch, q_len, max_seq_len, want):
    _, got = decode_launch(batch, 16, q_len, max_seq_len, 132, torch.bfloat16)
    assert (got.block_m, got.block_n, got.num_warps, got.num_stages) == want
    # float32 keeps the untuned tiles, unpipelined
    _, f32 = decode_launch(batch, 16, q_len, max_seq_len, 132, torch.float32)
    assert (f32.block_m, f32.num_stages) == ((16, 3) if q_len == 1 else (32, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [4, 16, 128])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4, 5])
def test_decode_configs_lists_every_pick(heads, q_len, dtype):
    # The warm-up compiles decode_configs(); a pick outside it would compile while serving.
    listed = decode_configs(heads, q_len, dtype)
    for rows in range(1, 300, 7):
        for max_seq_len in (1, 16, 64, 100, 300, 1000, 3000, 8256, 20000, 131072):
            assert decode_launch(rows, heads, q_len, max_seq_len, 132, dtype)[1] in listed, (rows, max_seq_len)


@in_process
@pytest.mark.parametrize("q_len", [1, 2])
def test_warm_up_decode_launches_each_variant(q_len):
    cache = torch.randn(3, 4, 32 + 16, device=DEVICE, dtype=torch.float16)
    # 2·q_len (position, head) pairs a row: one row and enough rows to fill the (interpreter's 8) SMs,
    # for both merge widths (and, one token, the merge that projects values) x each listed config x
    # (one split, two)
    assert warm_up_decode(cache, 0, 2, q_len, 16, 8, 0.3) == 2 * len(decode_configs(2, q_len, torch.float16)) * 2


def test_split_tiles_compile_to_short_mma_chains():
    """The split kernel's scores at V2-Lite's rank: on the MMAs of the small and middle tiles no HMMA
    waits on a chain of more than 12 before it (the four latent chunks' 8 and the rope part's 4; one
    dot over the 512 columns was a chain of 32 + 4), with no fewer MMAs in all; the 64-pair tile stays on
    warpgroup MMAs. One token's kernel, a programmatic dependent, loads the row's length and its first
    pages before its wait (the length and one page a thread at least); the others never wait. sm90 SASS
    from Triton's own ptxas, no GPU needed (split_sass.py, in a child process without the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, str(Path(__file__).with_name("split_sass.py"))], env=env,
                           capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-3000:]
    found = json.loads(child.stdout)
    assert {key.split(",")[1] for key in found} == {"16", "32", "64"}, found
    for key, tile in found.items():
        block_m = int(key.split(",")[1])
        if block_m >= 64:
            assert tile["hgmma"] > 0 and tile["hmma"] == 0, (key, tile)
        else:
            # A warp's MMAs: on four warps 36 for the scores (8 keys a warp) and 32 for the values, twice that
            # at 32 pairs; on eight warps 16 pairs' scores have only four 8-key blocks, so pairs of warps
            # compute the same 36, and the values are halved (16).
            want = 36 + 16 if (block_m, int(key.split(",")[3])) == (16, 8) else 68 * block_m // 16
            assert tile["hmma"] == want and tile["longest_chain"] <= 12, (key, tile)
        if key.startswith("1,"):
            assert tile["loads_before_wait"] >= 2, (key, tile)
        else:
            assert tile["loads_before_wait"] is None, (key, tile)


def values_reference(latent, w_vc):
    """[T, H, dv]: the latent output rounded to w_vc's dtype (as it is stored between the two
    kernels), times W_vcᵀ per head, in float32."""
    return torch.einsum("thr,hvr->thv", latent.to(w_vc.dtype).float(), w_vc.float())


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_splits", [1, 3, 37])
@pytest.mark.parametrize(("seq_lens", "q_len"), [([70], 1), ([1], 1), ([9, 40], 1), ([30], 2)],
                         ids=["one-token", "one-key", "two-rows", "two-tokens"])
def test_decode_values_match_reference(seq_lens, q_len, num_kv_splits, dtype, monkeypatch):
    """With w_vc, out is the values. One token with split keys takes the merge kernel that projects
    them (its programs merging a head's splits themselves: 37 splits, most of them empty); every
    other step the latent output and ``project_values``. Both match the float32 reference, and what
    the latent output followed by ``project_values`` gives (the same sums, up to their order)."""
    heads, rank, rope, dv, scale = 3, 32, 16, 24, 0.3
    q_lat, q_pe, cache, page_table, lens = make_decode(seq_lens, q_len, heads, rank, rope, 4, dtype)
    gen = torch.Generator().manual_seed(5)
    # W_vc as the model has it: a [H, dv, R] view of kv_b_proj's rows, [k_nope (dn) | v (dv)] per head
    w_vc = torch.randn(heads, 8 + dv, rank, generator=gen).to(device=DEVICE, dtype=dtype)[:, 8:]
    out = torch.full((q_lat.shape[0], heads, dv), float("nan"), dtype=dtype, device=DEVICE)
    projections = []
    monkeypatch.setattr(triton_mla, "project_values", lambda *args: projections.append(project_values(*args)))
    mla_decode(q_lat, q_pe, cache, page_table, lens, q_len, scale, out, w_vc=w_vc, num_kv_splits=num_kv_splits)
    merged_with_values = len(seq_lens) * q_len == 1 and num_kv_splits > 1
    assert len(projections) == (0 if merged_with_values else 1)
    ref = values_reference(decode_reference(q_lat, q_pe, cache, page_table, lens, q_len, scale), w_vc)
    assert max_rel_error(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)

    latent = torch.empty_like(q_lat)
    mla_decode(q_lat, q_pe, cache, page_table, lens, q_len, scale, latent, num_kv_splits=num_kv_splits)
    two_kernels = torch.empty_like(out)
    project_values(latent, w_vc, two_kernels)
    assert max_rel_error(out, two_kernels.float()) < (1e-6 if dtype == torch.float32 else 1e-3)


@in_process
def test_decode_rejects_bad_inputs():
    q_lat, q_pe, cache, page_table, lens = make_decode([5, 9], 1, 4, 32, 16, 4, torch.float32)
    out = torch.empty_like(q_lat)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode(q_lat, q_pe, cache, page_table, lens.long(), 1, 0.2, out)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_decode(q_lat, q_pe, cache[..., :40], page_table, lens, 1, 0.2, out)
    with pytest.raises(ValueError, match="q_len=3"):
        mla_decode(q_lat, q_pe, cache, page_table, lens, 3, 0.2, out)
    with pytest.raises(ValueError, match="num_kv_splits=65"):
        mla_decode(q_lat, q_pe, cache, page_table, lens, 1, 0.2, out, num_kv_splits=65)
    with pytest.raises(ValueError, match="block_n=24"):
        KernelConfig(block_m=16, block_n=24, num_warps=4, num_stages=1)
    w_vc = torch.zeros(4, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"w_vc \(4, 16, 31\)"):
        mla_decode(q_lat, q_pe, cache, page_table, lens, 1, 0.2, out[..., :16], w_vc=w_vc[..., :31])
    with pytest.raises(ValueError, match=r"out \(2, 4, 32\): expected \[2, 4, 16\]"):
        mla_decode(q_lat, q_pe, cache, page_table, lens, 1, 0.2, out, w_vc=w_vc)


# ---------------------------------------------------------------- prefill (CPU: interpreter)

@in_process
@pytest.mark.parametrize("config", [SMALL, KernelConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)],
                         ids=["m16", "m32"])
@pytest.mark.parametrize("dims", [(24, 20), (32, 16)], ids=["d24-dv20", "d32-dv16"])
@pytest.mark.parametrize("rows", [
    [(0, 7), (0, 1), (0, 40)],  # no prefix
    [(0, 7), (5, 1), (17, 20), (9, 0), (3, 33)],  # prefixes, a row with no new tokens, several tiles
], ids=["no-prefix", "prefix"])
def test_prefill_matches_reference(rows, dims, config):
    dim, dim_v = dims
    q, k, v, qo, kv, prefix = make_prefill(rows, 3, dim, dim_v, torch.float32)
    out = torch.full((q.shape[0] + 2, 3, dim_v), 7.0, device=DEVICE)  # two tokens no row owns
    mla_prefill(q, k, v, qo, kv, prefix, 0.25, out[:q.shape[0]], config=config)
    ref = prefill_reference(q, k, v, qo, kv, prefix, 0.25)
    assert max_rel_error(out[:q.shape[0]], ref) < 1e-5
    assert (out[q.shape[0]:] == 7.0).all()


@in_process
def test_prefill_many_rows():
    """More rows than the kernel scans at a time (16): programs past the first chunk find their row."""
    rows = [(i % 5, 1 + (7 * i) % 23) for i in range(37)]
    rows[20] = (3, 0)  # a row with no new tokens, in the second chunk
    q, k, v, qo, kv, prefix = make_prefill(rows, 2, 32, 16, torch.float32)
    out = torch.empty(q.shape[0], 2, 16, device=DEVICE)
    mla_prefill(q, k, v, qo, kv, prefix, 0.25, out, config=SMALL)
    assert max_rel_error(out, prefill_reference(q, k, v, qo, kv, prefix, 0.25)) < 1e-5


@in_process
def test_prefill_float16():
    q, k, v, qo, kv, prefix = make_prefill([(4, 9), (30, 17)], 2, 48, 32, torch.float16)
    out = torch.empty(q.shape[0], 2, 32, dtype=torch.float16, device=DEVICE)
    mla_prefill(q, k, v, qo, kv, prefix, 48 ** -0.5, out, config=SMALL)
    assert max_rel_error(out, prefill_reference(q, k, v, qo, kv, prefix, 48 ** -0.5)) < 2e-3


@in_process
def test_prefill_rejects_bad_inputs():
    q, k, v, qo, kv, prefix = make_prefill([(0, 4)], 2, 32, 16, torch.float32)
    out = torch.empty(4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="qo_indptr"):
        mla_prefill(q, k, v, qo.long(), kv, prefix, 0.2, out)
    with pytest.raises(ValueError, match="out"):
        mla_prefill(q, k, v, qo, kv, prefix, 0.2, out[..., :8])


test_cpu_tests_in_child_process = rerun_in_child(__file__)


# ---------------------------------------------------------------- GPU: real sizes, CUDA graphs

BF16_TOL = 1e-2  # per-token relative error with bf16 inputs (p is rounded to bf16 for the PV dot); expect ~3e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_kv_splits", [1, None])
def test_decode_real_sizes_gpu(heads, q_len, page_size, dtype, num_kv_splits):
    seq_lens = [q_len, 1000, 4099, 16384 + 77]
    q_lat, q_pe, cache, page_table, lens = make_decode(seq_lens, q_len, heads, 512, 64, page_size, dtype)
    out = torch.empty_like(q_lat)
    mla_decode(q_lat, q_pe, cache, page_table, lens, q_len, 192 ** -0.5, out, num_kv_splits=num_kv_splits)
    ref = decode_reference(q_lat, q_pe, cache, page_table, lens, q_len, 192 ** -0.5)
    assert max_rel_error(out, ref) < (BF16_TOL if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize(("q_len", "config"), [
    (1, KernelConfig(16, 32, 4, 5)), (2, KernelConfig(32, 64, 8, 5)), (4, KernelConfig(64, 64, 8, 3)),
    (3, KernelConfig(64, 64, 8, 3)), (4, KernelConfig(16, 32, 4, 5)), (1, KernelConfig(16, 32, 4, 7)),
    (1, KernelConfig(16, 32, 8, 3))],
    ids=["q1-m16-pipelined", "q2-m32-pipelined", "q4-m64-wgmma", "q3-m64-idle-lanes", "q4-m16-pipelined",
         "q1-three-buffers", "q1-m16-one-row-warps"])
@pytest.mark.parametrize("num_kv_splits", [1, 5])
def test_decode_tuned_configs_gpu(q_len, config, page_size, dtype, num_kv_splits):
    """The launch settings ``decode_launch`` picks, each forced on rows shorter than one tile, across
    page and split boundaries, and long enough for the pipelined loop to run many iterations."""
    seq_lens = [q_len, 37, 1000, 4099 + q_len, 9000]
    q_lat, q_pe, cache, page_table, lens = make_decode(seq_lens, q_len, 16, 512, 64, page_size, dtype)
    out = torch.empty_like(q_lat)
    mla_decode(q_lat, q_pe, cache, page_table, lens, q_len, 192 ** -0.5, out, num_kv_splits=num_kv_splits,
               config=config)
    ref = decode_reference(q_lat, q_pe, cache, page_table, lens, q_len, 192 ** -0.5)
    assert max_rel_error(out, ref) < BF16_TOL


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_cuda_graph_replay_gpu(q_len):
    """Capture once with the page table's full width (so the split count is fixed), then change
    seq_lens and the page table in place: the replay must follow the new contents."""
    heads, scale = 16, 192 ** -0.5
    first = make_decode([300, 5000, 12000, q_len], q_len, heads, 512, 64, 64, torch.bfloat16, spare_pages=60, seed=1)
    second = make_decode([9000, q_len, 700, 15000], q_len, heads, 512, 64, 64, torch.bfloat16, spare_pages=0, seed=2)
    q_lat, q_pe, cache, page_table, lens = (t.clone() for t in first)
    cache = torch.cat([cache, second[2]])  # both caches' pages, the second's numbered after the first's
    out = torch.empty_like(q_lat)

    def run():
        mla_decode(q_lat, q_pe, cache, page_table, lens, q_len, scale, out)

    run()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    assert max_rel_error(out, decode_reference(q_lat, q_pe, cache, page_table, lens, q_len, scale)) < BF16_TOL

    q_lat.copy_(second[0])
    q_pe.copy_(second[1])
    lens.copy_(second[4])
    assert second[3].shape[1] <= page_table.shape[1]
    page_table.fill_(0)
    page_table[:, :second[3].shape[1]] = second[3] + first[2].shape[0]
    graph.replay()
    assert max_rel_error(out, decode_reference(q_lat, q_pe, cache, page_table, lens, q_len, scale)) < BF16_TOL


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("seq_len", [1, 1000, 16384 + 77])
def test_decode_values_one_token_gpu(heads, seq_len, dtype):
    """One token's values through the merge that projects them (a programmatic dependent of the split
    kernel on sm90+), at real sizes and split counts (a table of 16k keys: 64 splits, most of them
    empty for short rows): the float32 reference within tolerance, the latent output followed by
    ``project_values`` within rounding (the splits are summed in another order), the split kernel
    launched as a dependent (``tables_ready``: the length and first pages read before its wait; at 16k
    keys a split has several tiles) bit for bit, and a CUDA graph's replay of that bit for bit."""
    q_lat, q_pe, cache, page_table, lens = make_decode([seq_len], 1, heads, 512, 64, 64, dtype, spare_pages=260)
    gen = torch.Generator().manual_seed(3)
    w_vc = (torch.randn(heads, 256, 512, generator=gen) * 0.05).to(device=DEVICE, dtype=dtype)[:, 128:]
    scale = 192 ** -0.5
    latent, two_kernels = torch.empty_like(q_lat), torch.empty(1, heads, 128, dtype=dtype, device=DEVICE)
    mla_decode(q_lat, q_pe, cache, page_table, lens, 1, scale, latent)
    project_values(latent, w_vc, two_kernels)
    out = torch.empty_like(two_kernels)

    def run(tables_ready=True):
        mla_decode(q_lat, q_pe, cache, page_table, lens, 1, scale, out, w_vc=w_vc, tables_ready=tables_ready)

    run(tables_ready=False)
    eager = out.clone()
    assert max_rel_error(eager, two_kernels.float()) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    ref = values_reference(decode_reference(q_lat, q_pe, cache, page_table, lens, 1, scale), w_vc)
    assert max_rel_error(eager, ref) < (BF16_TOL if dtype == torch.bfloat16 else 1e-4)
    out.zero_()
    run()
    assert torch.equal(out, eager)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.zero_()
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [[(0, 1000), (0, 37)], [(0, 1000), (3000, 512), (16, 1), (8000, 200)],
                                  [(0, 20)] * 16], ids=["no-prefix", "prefix", "short-rows"])
@pytest.mark.parametrize("shape", [(16, 192, 128, torch.bfloat16, BF16_TOL), (4, 96, 32, torch.float32, 1e-4)],
                         ids=["v2-lite-bf16", "tiny-fp32"])
def test_prefill_real_sizes_and_graph_gpu(rows, shape):
    """The default tiles of each dtype (``default_prefill_config``) at real head shapes."""
    heads, dim, dim_v, dtype, tol = shape
    q, k, v, qo, kv, prefix = make_prefill(rows, heads, dim, dim_v, dtype)
    out = torch.empty(q.shape[0], heads, dim_v, dtype=dtype, device=DEVICE)

    def run():
        mla_prefill(q, k, v, qo, kv, prefix, dim ** -0.5, out)

    run()
    assert max_rel_error(out, prefill_reference(q, k, v, qo, kv, prefix, dim ** -0.5)) < tol
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    assert max_rel_error(out, prefill_reference(q, k, v, qo, kv, prefix, dim ** -0.5)) < tol

