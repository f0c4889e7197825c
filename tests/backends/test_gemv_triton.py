"""The small-M GEMV (``gemv_triton.gemv``) and the ``encore::dense`` op against float32 torch.

Without CUDA the kernel runs in Triton's interpreter (float32 and float16; ``triton_interpreter.py``
says why the CPU tests may run in a child process); the GPU tests (``-m gpu``) cover
bfloat16 at DeepSeek's shapes, the programmatic dependent launch inside a CUDA graph, and the op's
dispatch by token count.
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

from encore.backends.dense import (
    GEMV_MAX_K, absorb_query, add_rms_norm_dense, dense, gemv_pays, project_values, rms_norm, rms_norm_dense,
    runs_batched_gemv, runs_gemv)
from encore.backends.gemv_triton import MAX_TOKENS, batched_gemv, gemv, rms_norm_gemv, tile
from encore.backends.gemv_triton import rms_norm as rms_norm_triton

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


def norm_operands(tokens: int, k: int, dtype: torch.dtype, seed: int, row_stride: int | None = None):
    """x [tokens, k] (rows ``row_stride`` apart), delta like x, a norm weight [k] around 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, row_stride or k, generator=gen).to(DEVICE, dtype)[:, :k]
    delta = torch.randn(tokens, k, generator=gen).to(DEVICE, dtype)
    norm_weight = (1 + 0.5 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    return x, delta, norm_weight


@in_process
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(37, 1408), (5, 100), (64, 256)])
@pytest.mark.parametrize("add", [False, True])
def test_norm_gemv_matches_norm_then_matmul(tokens, n, k, add):
    """``rms_norm_gemv``: each program's norm of x (+ delta) is ``dense.rms_norm``'s, the sum is stored
    once, exactly; strided x rows."""
    x, delta, norm_weight = norm_operands(tokens, k, torch.float32, seed=tokens + k, row_stride=k + 24)
    w = operands(1, n, k, torch.float32, seed=n)[1]
    total = x + delta if add else x
    out, out_total, normed = rms_norm_gemv(x, norm_weight, 1e-6, w, delta if add else None, keep_normed=add)
    assert rel_err(out, rms_norm(total, norm_weight, 1e-6) @ w.t()) < 1e-5
    assert (out_total is None) != add and (not add or torch.equal(out_total, total))
    assert (normed is None) != add and (not add or rel_err(normed, rms_norm(total, norm_weight, 1e-6)) < 1e-6)


@in_process
@pytest.mark.parametrize("add", [False, True])
def test_norm_kernel_float16_rounds_as_torch(add):
    """The row norm alone (the kernel past the GEMV's token counts): float16 sums and normed rows equal
    ``dense.rms_norm``'s roundings but for a unit in the last place of a few elements."""
    x, delta, norm_weight = norm_operands(9, 1408, torch.float16, seed=5)
    total = x + delta if add else x
    normed, out_total = rms_norm_triton(x, norm_weight, 1e-6, delta if add else None)
    want = rms_norm(total, norm_weight, 1e-6)
    assert normed.dtype == torch.float16 and (normed.float() - want.float()).abs().max() <= 2e-3 * want.abs().max()
    assert (normed != want).float().mean() < 0.02
    assert out_total is None if not add else torch.equal(out_total, total)


@in_process
def test_norm_rejects_a_weight_of_another_size():
    x, delta, norm_weight = norm_operands(1, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"norm weight \(63,\)"):
        rms_norm_gemv(x, norm_weight[:63], 1e-6, torch.zeros(8, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"delta \(\(1, 32\)"):
        rms_norm_triton(x, norm_weight, 1e-6, delta[:, :32])


def test_norm_dense_ops_on_cpu_against_torch_rms_norm():
    """The ops' references against torch's own ``rms_norm`` (float32: no rounding in between)."""
    x, delta, norm_weight = torch.randn(3, 40), torch.randn(3, 40), torch.rand(40) + 0.5
    w = torch.randn(7, 40)

    def want(rows):
        return torch.nn.functional.rms_norm(rows, (40,), norm_weight, 1e-6) @ w.t()

    torch.testing.assert_close(rms_norm_dense(x, norm_weight, 1e-6, w), want(x))
    out, total = add_rms_norm_dense(x, delta, norm_weight, 1e-6, w)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(out, want(x + delta))


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


# V2-Lite's weights (elements) and the token counts the GEMV takes them at (H200 and H100 timings,
# sessions 31 and 44, dense.py): past one token the GEMV's cost grows with tokens times weight.
V2_LITE_GEMV_TOKENS = {"q/kv_a": (3648 * 2048, [1]), "o_proj": (2048 * 2048, [1, 2]),
                       "router": (64 * 2048, [1, 2, 3, 4]), "lm_head": (102400 * 2048, [1])}


def test_aligned_strides_compile_to_vector_loads():
    """At strides that are multiples of 8 (ALIGN 8) the GEMV's loads of W and x compile to 16-byte vectors
    and a thread holds at most 168 registers (three programs an SM), with the norm in it or not: sm90
    SASS from Triton's own ptxas, no GPU needed (gemv_sass.py, in a child process without the
    interpreter). Triton 3.9 gives both 128 registers (four programs an SM); 3.6, the GPU machine's,
    155 without the norm and 121 with it, and at 155 the LM head GEMV read 4.5 TB/s on an H200
    (benchmarks/README.md, "Session 49"). The launch does not specialize on strides, and without the
    hint (ALIGN 1) every element is a 2-byte load of its own."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, str(Path(__file__).with_name("gemv_sass.py"))], env=env,
                           capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-3000:]
    found = json.loads(child.stdout)
    for norm in (False, True):
        aligned, unaligned = found[f"8,{norm}"], found[f"1,{norm}"]
        assert set(aligned["loads"]) == {"LDG.E.128"} and aligned["registers"] <= 168, (norm, aligned)
        assert unaligned["loads"].get("LDG.E.U16", 0) >= 128, (norm, unaligned)


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


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n, k", [(3648, 2048), (2112, 7168), (3072, 1536)])
def test_norm_dense_ops_gpu(n, k):
    """The fused ops in bf16 at DeepSeek's sizes: the GEMV with the norm in front where ``runs_gemv``,
    else the norm kernel and cuBLAS; against float32 math on the bf16-rounded norm (as the graph's own
    norm rounds), and the residual sum exact."""
    w = operands(1, n, k, torch.bfloat16, seed=n)[1]
    for tokens in (1, 2, 4, 8, 64):
        x, delta, norm_weight = norm_operands(tokens, k, torch.bfloat16, seed=tokens)
        ref = rms_norm(x, norm_weight, 1e-6).float() @ w.float().t()
        assert rel_err(rms_norm_dense(x, norm_weight, 1e-6, w), ref) < BF16_TOL, tokens
        out, total = add_rms_norm_dense(x, delta, norm_weight, 1e-6, w)
        assert torch.equal(total, x + delta), tokens
        assert rel_err(out, rms_norm(x + delta, norm_weight, 1e-6).float() @ w.float().t()) < BF16_TOL, tokens


@pytest.mark.gpu
@needs_cuda
def test_norm_gemv_chain_in_a_cuda_graph_gpu():
    """Each fused call's x and delta come from the call before (a residual stream): replayed on new
    inputs the graph equals eager calls, so no program reads x, delta or writes the sum early."""
    k = 2048
    ws = [operands(1, k, k, torch.bfloat16, seed=s)[1] for s in range(6)]
    norm_weight = norm_operands(1, k, torch.bfloat16, seed=1)[2]
    static = torch.zeros(2, 1, k, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        residual, delta = x[0], x[1]
        for w in ws:
            delta, residual, _ = rms_norm_gemv(residual, norm_weight, 1e-6, w, delta)
        return delta, residual

    chain(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    x = norm_operands(2, k, torch.bfloat16, seed=9)[0][:, None]
    static.copy_(x)
    graph.replay()
    want = chain(x)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


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
