"""The Triton attention backend against the torch reference (``forward``, cache write included; prefill
rows on both of its paths, eager and static), its selection by the engine, and its greedy tokens inside
CUDA graphs.

Without CUDA the float32 comparisons run in Triton's interpreter (``triton_interpreter.py`` says why
TRITON_INTERPRET must be set before triton is imported, and why a child process runs them when another
module imported triton first); bfloat16 and the engine run only on the GPU (``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import in_process, rerun_in_child  # before anything imports triton

from encore.backends.dense import absorb_query
from encore.backends.torch_backend import TorchAttentionBackend
from encore.backends.triton_backend import TritonAttentionBackend
from attention_cases import LAYOUTS, SMALL_DIMS, check_against_torch, make_step

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@in_process
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this on CUDA")
@pytest.mark.parametrize("static", [False, True], ids=["eager-plan", "static-plan"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_torch_in_interpreter(layout, page_size, static):
    check_against_torch(TritonAttentionBackend, *LAYOUTS[layout], page_size, torch.float32, static=static)


@in_process
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this on CUDA")
def test_decode_takes_a_given_latent_query_in_interpreter():
    check_given_latent_query(torch.float32)


test_cpu_tests_in_child_process = rerun_in_child(__file__)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("static", [False, True], ids=["eager-plan", "static-plan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_torch_gpu(layout, page_size, dtype, static):
    check_against_torch(TritonAttentionBackend, *LAYOUTS[layout], page_size, dtype, static=static)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_takes_a_given_latent_query_gpu(dtype):
    check_given_latent_query(dtype)


def check_given_latent_query(dtype: torch.dtype) -> None:
    """A decode step given its latent query (``mla_ops.rope_absorb``'s) gives what it gives computing
    the query itself, and uses the one given (another one changes the output); the torch reference
    absorbs in float32 itself whatever it is given."""
    batch, cache, (q_nope, q_pe, _, _, w_kc, w_vc) = make_step([], [1, 40], 1, 16, dtype)
    outputs = {}
    for name, cls in (("triton", TritonAttentionBackend), ("torch", TorchAttentionBackend)):
        backend = cls([cache], SMALL_DIMS)
        backend.plan(batch)
        for q_lat in (None, absorb_query(q_nope, w_kc), torch.zeros_like(absorb_query(q_nope, w_kc))):
            out = torch.empty(q_nope.shape[0], q_nope.shape[1], w_vc.shape[1], dtype=dtype, device=q_nope.device)
            backend.decode(q_nope, q_pe, w_kc, w_vc, cache, out, batch, q_lat=q_lat)
            outputs[name, None if q_lat is None else bool(q_lat.any())] = out
    assert torch.equal(outputs["triton", None], outputs["triton", True])
    assert not torch.allclose(outputs["triton", None], outputs["triton", False])
    assert torch.equal(outputs["torch", None], outputs["torch", True])
    assert torch.equal(outputs["torch", None], outputs["torch", False])


# ---------------------------------------------------------------- the engine

@pytest.mark.gpu
@needs_cuda
def test_engine_cuda_graphs_greedy_equals_torch():
    from encore.engine import Engine, SamplingParams

    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "x" * 70]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", max_model_len=256, compile=False, cuda_graphs=True,
                   graph_decode_sizes=(1, 2, 4), graph_mixed_decode_sizes=(4,), graph_prefill_tokens=(64,))
    want = [o.token_ids for o in Engine(attention_backend="torch", **options).generate(prompts, params)]
    engine = Engine(attention_backend="triton", **options)
    assert engine.runner.backend.name == "triton"
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    stats = engine.stats()
    assert stats["graph_replays"] > 0, stats
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
