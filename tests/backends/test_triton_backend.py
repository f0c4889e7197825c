"""The Triton attention backend against the torch reference (``forward``, cache write included), its
selection by the engine, and its greedy tokens inside CUDA graphs.

Without CUDA the float32 comparisons run in Triton's interpreter, as in ``test_triton_mla`` (whose
docstring says why TRITON_INTERPRET must be set before triton is imported, and why a child process runs
them when another module imported triton first); bfloat16 and the engine run only on the GPU (``-m gpu``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TOO_LATE = (not torch.cuda.is_available() and "triton" in sys.modules
            and os.environ.get("TRITON_INTERPRET") != "1")
if not torch.cuda.is_available() and not TOO_LATE:
    os.environ["TRITON_INTERPRET"] = "1"

from encore.backends.base import MLADims  # noqa: E402
from encore.backends.context import StepContext  # noqa: E402
from encore.backends.metadata import ForwardBatch  # noqa: E402
from encore.backends.torch_backend import TorchAttentionBackend  # noqa: E402
from encore.backends.triton_backend import TritonAttentionBackend  # noqa: E402
from encore.engine.model_runner import select_backend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
in_process = pytest.mark.skipif(TOO_LATE, reason="triton was imported before the interpreter was enabled; "
                                "test_cpu_tests_in_child_process runs these")
DIMS = MLADims(num_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kv_lora_rank=64,
               softmax_scale=48 ** -0.5)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PADDING = 3  # bucket-padding tokens after the prefill rows' tokens, owned by no row


def make_step(extends: list[tuple[int, int]], decodes: list[int], q_len: int, page_size: int,
              dtype: torch.dtype, seed: int = 0):
    """A step of prefill rows (prefix_len, new_tokens), then decode rows (seq_len, q_len tokens each),
    over a random latent cache with shuffled pages (page 0: the dummy page padding writes to), and
    random q / latents / weights. Returns (batch, cache, inputs)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in extends] + decodes
    prefix = [p for p, _ in extends] + [s - q_len for s in decodes]
    max_pages = max(-(-s // page_size) for s in lens) + 1  # a spare column, left 0
    needed = sum(-(-s // page_size) for s in lens)
    pages = (torch.randperm(needed, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens), max_pages, dtype=torch.int32)
    for b, s in enumerate(lens):
        for j in range(-(-s // page_size)):
            table[b, j] = pages.pop()
    positions, slots = [], []
    qo = [0]
    for b, (p, s) in enumerate(zip(prefix, lens)):
        pad = PADDING if b == len(extends) and extends else 0
        # bucket padding after the prefill tokens (as graphs/padding.py lays it out): position 0, the
        # dummy page, outside qo_indptr[E]; the decode rows' offsets count it
        positions += [0] * pad
        slots += [0] * pad
        for pos in range(p, s):
            positions.append(pos)
            slots.append(int(table[b, pos // page_size]) * page_size + pos % page_size)
        qo.append(qo[-1] + pad + s - p)
    if not decodes:
        positions += [0] * PADDING
        slots += [0] * PADDING
    tokens = len(positions)
    to = dict(device=DEVICE)
    batch = ForwardBatch(
        num_extends=len(extends), q_len_per_req=q_len, bs=len(lens), num_tokens=tokens, page_size=page_size,
        input_ids=torch.zeros(tokens, dtype=torch.int64, **to), positions=torch.tensor(positions, **to),
        slot_mapping=torch.tensor(slots, **to), seq_lens=torch.tensor(lens, dtype=torch.int32, **to),
        prefix_lens=torch.tensor(prefix, dtype=torch.int32, **to), qo_indptr=torch.tensor(qo, dtype=torch.int32, **to),
        page_table=table.to(DEVICE), gather_ids=torch.arange(tokens, **to), seq_lens_cpu=lens, prefix_lens_cpu=prefix)
    d = DIMS
    cache = torch.randn(needed + 1, page_size, d.latent_dim, generator=gen).to(DEVICE, dtype)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    inputs = (rand(tokens, d.num_heads, d.qk_nope_head_dim), rand(tokens, d.num_heads, d.qk_rope_head_dim),
              rand(tokens, d.kv_lora_rank), rand(tokens, d.qk_rope_head_dim),
              rand(d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank, scale=d.kv_lora_rank ** -0.5),
              rand(d.num_heads, d.v_head_dim, d.kv_lora_rank, scale=d.kv_lora_rank ** -0.5))
    return batch, cache, inputs


def run_backend(cls, batch: ForwardBatch, cache: torch.Tensor, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    caches = [cache.clone()]
    backend = cls(caches, DIMS)
    backend.plan(batch)
    with StepContext(backend).bind(batch):
        out = backend.forward(0, *inputs, batch)
    return out, caches[0]


def real_tokens(batch: ForwardBatch) -> torch.Tensor:
    """Token indices that belong to a row (bucket padding excluded)."""
    keep = torch.ones(batch.num_tokens, dtype=torch.bool)
    end = batch.qo_indptr[batch.num_extends].item() if batch.num_extends else 0
    keep[end:batch.num_extend_tokens] = False
    return keep.nonzero().flatten().to(DEVICE)


def max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref.float()).flatten(1).norm(dim=1)
    return (diff / ref.float().flatten(1).norm(dim=1).clamp_min(1.0)).max().item()


def check_against_torch(extends, decodes, q_len, page_size, dtype):
    batch, cache, inputs = make_step(extends, decodes, q_len, page_size, dtype)
    got, got_cache = run_backend(TritonAttentionBackend, batch, cache, inputs)
    want, want_cache = run_backend(TorchAttentionBackend, batch, cache, inputs)
    assert torch.equal(got_cache[1:], want_cache[1:])  # page 0: padding writes, in no fixed order
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()  # bucket padding included
    keep = real_tokens(batch)
    assert max_rel_error(got[keep], want[keep]) < TOL[dtype]


LAYOUTS = {
    "decode-q1": ([], [1, 5, 40, 77], 1),
    "decode-q3": ([], [3, 9, 40, 70], 3),
    "prefill": ([(0, 7), (0, 1), (0, 33)], [], 1),
    "prefill-prefix": ([(5, 7), (0, 4), (30, 20)], [], 1),
    "mixed": ([(3, 9), (0, 5)], [1, 17, 50], 1),
    "mixed-q3": ([(20, 6)], [3, 33], 3),
}


@in_process
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this on CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_torch_in_interpreter(layout, page_size):
    check_against_torch(*LAYOUTS[layout], page_size, torch.float32)


@pytest.mark.skipif(not TOO_LATE, reason="the CPU tests ran in this process")
def test_cpu_tests_in_child_process():
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                           env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert child.returncode == 0, child.stdout[-5000:] + child.stderr[-2000:]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_torch_gpu(layout, page_size, dtype):
    check_against_torch(*LAYOUTS[layout], page_size, dtype)


# ---------------------------------------------------------------- selection and the engine

def test_selection_on_cpu():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu) is TorchAttentionBackend
    assert select_backend("torch", cpu) is TorchAttentionBackend
    with pytest.raises(ValueError, match="'triton' needs a CUDA device, got device 'cpu'"):
        select_backend("triton", cpu)


def test_engine_triton_on_cpu_is_refused():
    from encore.engine import Engine

    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(device="cpu", dtype="float32", attention_backend="triton", max_model_len=64)


@pytest.mark.gpu
@needs_cuda
def test_selection_on_cuda():
    assert select_backend("auto", torch.device("cuda")) is TritonAttentionBackend
    assert select_backend("triton", torch.device("cuda")) is TritonAttentionBackend


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
