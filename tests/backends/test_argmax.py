"""``argmax_rows`` (backends/argmax.py) and its CUDA kernels (backends/argmax_triton.py) against
``torch.argmax``: random rows, ties, NaN, -inf, vocabularies that do and do not fill whole blocks and
chunks, one chunk a row or many. Without CUDA the kernels run in Triton's interpreter
(``triton_interpreter.py``); ``-m gpu`` runs them compiled, in bfloat16 and float32."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import in_process, rerun_in_child  # before anything imports triton

from encore.backends.argmax import argmax_rows
from encore.backends.argmax_triton import BLOCK, MAX_CHUNKS, argmax_triton, pick, split

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_split_covers_the_row_in_whole_blocks():
    for rows, vocab, programs in [(1, 102400, 2048), (64, 102400, 2048), (3, 5000, 512), (1000, 7, 2048),
                                  (1, 129280, 512), (1, 1 << 20, 2048), (0, 4096, 512)]:
        chunks, width = split(rows, vocab, programs)
        assert width % BLOCK == 0 and (chunks - 1) * width < vocab <= chunks * width, (rows, vocab)
        assert chunks <= MAX_CHUNKS
    assert split(1, 102400, 2048) == (100, 1024)
    assert split(64, 102400, 2048) == (25, 4096)
    assert split(1, 1 << 20, 2048) == (512, 2048)  # capped at MAX_CHUNKS


def rows_like(kind: str, rows: int, vocab: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=gen)
    if kind == "ties":  # few distinct values: every row's maximum appears many times, across chunks
        x = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    elif kind == "late_max":  # the maximum only in the last chunk, twice
        x[:, -1] = x[:, -7] = 100.0
    elif kind == "nan":  # two NaNs after a larger value: the first NaN wins
        x[:, vocab // 4] = 100.0
        x[:, vocab // 3] = x[:, vocab // 2] = float("nan")
    elif kind == "neg_inf":
        x.fill_(float("-inf"))
    return x.to(device, dtype)


@in_process
@pytest.mark.parametrize("kind", ["random", "ties", "late_max", "nan", "neg_inf"])
@pytest.mark.parametrize("rows,vocab", [(1, 20000), (3, 5000), (64, 3000), (2, 1024), (5, 7), (0, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_match_torch_argmax(kind, rows, vocab, dtype):
    x = rows_like(kind, rows, vocab, dtype, DEVICE)
    got = argmax_triton(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.argmax(dim=-1))


@in_process
def test_kernels_take_strided_rows():
    x = rows_like("random", 8, 5000, torch.float32, DEVICE)[::2]  # rows 10000 elements apart
    assert torch.equal(argmax_triton(x), x.argmax(dim=-1))
    with pytest.raises(ValueError, match="strides"):
        argmax_triton(x.t())


@in_process
def test_pick_takes_the_first_chunk_of_the_maximum_or_of_a_nan():
    nan, inf = float("nan"), float("inf")
    best = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, nan, inf, nan], [-inf, -inf, -inf, -inf]], device=DEVICE)
    where = torch.arange(12, device=DEVICE).view(3, 4) * 10
    assert pick(best, where).tolist() == [10, 50, 80]


test_cpu_tests_in_child_process = rerun_in_child(__file__)


def test_argmax_rows_off_cuda_launches_no_kernel(monkeypatch):
    import encore.backends.argmax_triton as argmax_triton

    def no_kernels(logits):
        raise AssertionError("a CPU tensor went to the Triton kernels")

    monkeypatch.setattr(argmax_triton, "argmax_triton", no_kernels)
    x = rows_like("ties", 4, 300, torch.float32, "cpu")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["random", "ties", "late_max", "nan", "neg_inf"])
@pytest.mark.parametrize("rows,vocab", [(1, 102400), (4, 102400), (64, 102400), (256, 129280), (2, 32001),
                                        (3000, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_torch_argmax_on_cuda(kind, rows, vocab, dtype):
    x = rows_like(kind, rows, vocab, dtype, "cuda")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replays_in_a_cuda_graph():
    """Captured (the head graphs' greedy pick), on logits the graph's own earlier kernel writes."""
    src = torch.randn(4, 102400, device="cuda", dtype=torch.bfloat16)
    argmax_rows(src * 1.0)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(src * 1.0)
    for seed in range(5):
        src.copy_(rows_like("random" if seed % 2 else "late_max", 4, 102400, torch.bfloat16, "cuda") * (seed + 1))
        graph.replay()
        assert torch.equal(out, src.argmax(dim=-1)), seed
