"""The small-M GEMV (``gemv_triton.gemv``) and the ``encore::dense`` op against float32 torch.

Without CUDA the kernel runs in Triton's interpreter (float32 and float16; ``triton_interpreter.py``
says why the CPU tests may run in a child process); the GPU tests (``-m gpu``) cover
bfloat16 at DeepSeek's shapes, the programmatic dependent launch inside a CUDA graph, and the op's
dispatch by token count.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import in_process, rerun_in_child  # before anything imports triton

from encore.backends.dense import (
    GEMV_MAX_K, absorb_query, dense, gemv_pays, project_values, runs_batched_gemv, runs_gemv)
from encore.backends.gemv_triton import MAX_TOKENS, batched_gemv, gemv, tile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def operands(tokens: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, row_stride: int | None = None):
    """x [tokens, k] (rows ``row_stride`` apart), w [n, k], scaled so outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    stride = row_stride or k
    x = torch.randn(tokens, stride, generator=gen).to(DEVICE, dtype)[:, :k]
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, dtype)
    return x, w


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@in_process
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(37, 1408), (64, 256), (5, 100), (17, 4096)])
def test_matches_float32(tokens, n, k):
    x, w = operands(tokens, n, k, torch.float32, seed=tokens)
    assert rel_err(gemv(x, w), x @ w.t()) < 1e-5


@in_process
def test_strided_rows_float16_and_float32_out():
    x, w = operands(3, 24, 192, torch.float16, row_stride=320)
    assert x.stride(0) == 320
    ref = x.float() @ w.float().t()
    out = gemv(x, w, torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5
    half = gemv(x, w)
    assert half.dtype == torch.float16 and rel_err(half, ref) < 2e-3


def test_tile_holds_the_whole_reduction():
    for k in (100, 128, 1408, 2048, 7168, GEMV_MAX_K):
        for k_contiguous in (True, False):
            block_n, block_k = tile(k, 512, k_contiguous)
            assert block_k >= k and block_n * block_k <= GEMV_MAX_K and block_n >= 1


@in_process
@pytest.mark.parametrize("x_shape, w_shape, dtype, match", [
    ((MAX_TOKENS + 1, 64), (8, 64), torch.float32, r"x \(5, 64\)"),
    ((1, 64), (8, 32), torch.float32, r"w \(8, 32\)"),
    ((1, GEMV_MAX_K + 16), (8, GEMV_MAX_K + 16), torch.float32, "K <= 16384"),
    ((1, 64), (8, 64), torch.int32, "torch.int32"),
])
def test_rejects_what_it_cannot_take(x_shape, w_shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        gemv(torch.zeros(x_shape, dtype=dtype, device=DEVICE), torch.zeros(w_shape, dtype=dtype, device=DEVICE))


@in_process
def test_rejects_a_transposed_weight():
    w = torch.zeros(64, 8, device=DEVICE).t()
    with pytest.raises(ValueError, match=r"stride \(1, 8\)"):
        gemv(torch.zeros(1, 64, device=DEVICE), w)


def test_dense_op_on_cpu_is_the_matmul():
    x, w = torch.randn(3, 40), torch.randn(7, 40)
    assert torch.equal(dense(x, w), torch.mm(x, w.t()))


test_cpu_tests_in_child_process = rerun_in_child(__file__)


# ---------------------------------------------------------------- GPU: bf16, real shapes, graphs, dispatch

# bf16 operands, float32 sums, one bf16 rounding of each output (2^-8 relative).
BF16_TOL = 5e-3
SHAPES = [(3648, 2048), (2048, 2048), (64, 2048), (2112, 7168), (7168, 16384), (2048, 10944)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_bf16_real_shapes_gpu(n, k, tokens):
    x, w = operands(tokens, n, k, torch.bfloat16, seed=n + tokens)
    ref = x.float() @ w.float().t()
    assert rel_err(gemv(x, w), ref) < BF16_TOL
    assert rel_err(gemv(x, w, torch.float32), ref) < 1e-5
    assert torch.equal(gemv(x, w), gemv(x, w, pdl=False))


@pytest.mark.gpu
@needs_cuda
def test_chain_in_a_cuda_graph_gpu():
    """Each call reads the one before it: with PDL a call's weights load early, but x (the previous
    output) only after that kernel completes. The replay on new inputs must equal eager calls."""
    ws = [operands(1, 2048, 2048, torch.bfloat16, seed=s)[1] for s in range(6)]
    static = torch.zeros(2, 2048, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        for w in ws:
            x = torch.nn.functional.silu(gemv(x, w)) * 4
        return x

    chain(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    x = operands(2, 1, 2048, torch.bfloat16, seed=9)[0]
    static.copy_(x)
    graph.replay()
    assert torch.equal(out, chain(x))
    ref = x.float()
    for w in ws:
        ref = torch.nn.functional.silu(ref @ w.float().t()) * 4
    assert rel_err(out, ref) < 3e-2


# V2-Lite's weights (elements) and the token counts the GEMV takes them at (H200 timings, session 31,
# dense.py): past one token the GEMV's cost grows with tokens times weight.
V2_LITE_GEMV_TOKENS = {"q/kv_a": (3648 * 2048, [1]), "o_proj": (2048 * 2048, [1, 2]),
                       "router": (64 * 2048, [1, 2, 3, 4]), "lm_head": (102400 * 2048, [])}


def test_gemv_rule_by_tokens_and_weight():
    for name, (elements, gemv_tokens) in V2_LITE_GEMV_TOKENS.items():
        assert [t for t in range(0, 7) if gemv_pays(t, elements)] == gemv_tokens, name
    w_uv = 16 * 128 * 512  # the absorbed per-head products: at most two tokens
    assert [t for t in range(0, 7) if runs_batched_gemv(t, torch.empty(w_uv, device="meta"))] == [1, 2]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n", [3648, 2048, 64])
def test_dense_op_dispatch_by_tokens_gpu(n):
    """``encore::dense``: the GEMV where ``runs_gemv`` says, cuBLAS elsewhere (bit for bit each)."""
    for tokens in range(1, 7):
        x, w = operands(tokens, n, 2048, torch.bfloat16, seed=tokens)
        want = gemv(x, w) if runs_gemv(x, w) else torch.mm(x, w.t())
        assert torch.equal(torch.ops.encore.dense(x, w), want), tokens


def absorbed_operands(tokens: int, heads: int, dn: int, dv: int, rank: int, dtype: torch.dtype, seed: int):
    """Views of kv_b_proj's weight as the attention backends pass them, W_kc [H, dn, R] and W_vc
    [H, dv, R]; q_nope [T, H, dn] a strided view (as a slice of q); o_lat [T, H, R]."""
    gen = torch.Generator().manual_seed(seed)
    w_kv = (torch.randn(heads, dn + dv, rank, generator=gen) * rank ** -0.5).to(DEVICE, dtype)
    w_kc, w_vc = w_kv.split([dn, dv], dim=1)
    q_nope = torch.randn(tokens, heads, dn + 16, generator=gen).to(DEVICE, dtype)[:, :, :dn]
    o_lat = torch.randn(tokens, heads, rank, generator=gen).to(DEVICE, dtype)
    return q_nope, w_kc, w_vc, o_lat


@in_process
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_absorbed_projections_follow_the_gemv_rule(tokens):
    """``dense.absorb_query`` / ``project_values``: under ``runs_batched_gemv`` the batched GEMV (the
    same values as calling it), else a batched GEMM (torch.bmm's); either against float32 einsum."""
    q_nope, w_kc, w_vc, o_lat = absorbed_operands(tokens, 3, 24, 16, 40, torch.float32, seed=tokens)
    q_lat = absorb_query(q_nope, w_kc)
    assert q_lat.is_contiguous()  # flashinfer's MLA takes no other layout
    assert rel_err(q_lat, torch.einsum("thd,hdr->thr", q_nope, w_kc)) < 1e-5
    out = torch.full((tokens, 3, 16), float("nan"), device=DEVICE)
    project_values(o_lat, w_vc, out)
    assert rel_err(out, torch.einsum("thr,hvr->thv", o_lat, w_vc)) < 1e-5
    if runs_batched_gemv(tokens, w_vc):
        want_q = batched_gemv(q_nope, w_kc.transpose(1, 2), torch.empty(tokens, 3, 40, device=DEVICE))
        want_out = batched_gemv(o_lat, w_vc, torch.empty(tokens, 3, 16, device=DEVICE))
    else:
        want_q = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)
        want_out = torch.bmm(o_lat.transpose(0, 1), w_vc.transpose(1, 2)).transpose(0, 1)
    assert torch.equal(q_lat, want_q) and torch.equal(out, want_out)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("tokens", [1, 2])
def test_absorbed_projections_gpu(heads, tokens):
    """MLA's absorbed products per head in bf16 at DeepSeek's sizes: q_lat = q_nope · W_UK (the GEMV
    with N contiguous at one token) and out = o_lat · W_UVᵀ (K contiguous), into a strided output."""
    dv = 128
    q_nope, w_kc, w_vc, o_lat = absorbed_operands(tokens, heads, 128, dv, 512, torch.bfloat16, seed=heads)
    assert rel_err(absorb_query(q_nope, w_kc), torch.einsum("thd,hdr->thr", q_nope.float(), w_kc.float())) < BF16_TOL
    out = torch.empty(tokens, 2 * heads, dv, device="cuda", dtype=torch.bfloat16)[:, ::2]  # every other head
    project_values(o_lat, w_vc, out)
    assert rel_err(out, torch.einsum("thr,hvr->thv", o_lat.float(), w_vc.float())) < BF16_TOL


@in_process
def test_batched_matches_float32_both_layouts():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 40, generator=gen).to(DEVICE)
    w = torch.randn(3, 24, 40, generator=gen).to(DEVICE)
    out = torch.empty(2, 3, 24, device=DEVICE)
    batched_gemv(x, w, out)
    ref = torch.einsum("mgk,gnk->mgn", x, w)
    assert rel_err(out, ref) < 1e-5
    w_n_contiguous = w.transpose(1, 2).contiguous().transpose(1, 2)  # same values, N contiguous
    assert w_n_contiguous.stride(1) == 1
    out2 = torch.empty(2, 3, 24, device=DEVICE)
    batched_gemv(x, w_n_contiguous, out2)
    assert rel_err(out2, ref) < 1e-5


@in_process
def test_batched_rejects_a_weight_with_neither_dim_contiguous():
    w = torch.zeros(3, 24, 80, device=DEVICE)[:, :, ::2]
    with pytest.raises(ValueError, match=r"w \(3, 24, 40\)"):
        batched_gemv(torch.zeros(1, 3, 40, device=DEVICE), w, torch.empty(1, 3, 24, device=DEVICE))
