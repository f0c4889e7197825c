"""``argmax_rows`` (backends/argmax.py) against ``torch.argmax``: random rows, ties, NaN, -inf, vocabularies
that do and do not divide into chunks; on the CPU, and on CUDA in bfloat16 (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from encore.backends.argmax import argmax_rows, chunks


def test_chunks_rule():
    assert chunks(1, 102400) == 512  # capped
    assert chunks(64, 102400) == 128  # 8192 pieces
    assert chunks(256, 102400) == 32
    assert chunks(1, 129280) == 256  # V3's vocabulary, 2^8 · 505
    assert chunks(1, 65537) == 1  # odd: a plain argmax
    assert chunks(3, 98304) == 512  # 2730 pieces a row allowed, capped
    assert chunks(10000, 1 << 16) == 1  # more rows than pieces
    assert chunks(0, 1 << 16) == 512
    assert chunks(1, 32768) == 1  # a short row: one reduction


def rows_like(kind: str, rows: int, vocab: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=gen)
    if kind == "ties":  # few distinct values: every row's maximum appears many times, across chunks
        x = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    elif kind == "late_max":  # the maximum only in the last chunk, twice
        x[:, -1] = x[:, -7] = 100.0
    elif kind == "nan":
        x[:, vocab // 3] = x[:, vocab // 2] = float("nan")
    elif kind == "neg_inf":
        x.fill_(float("-inf"))
    return x.to(device, dtype)


@pytest.mark.parametrize("kind", ["random", "ties", "late_max", "nan", "neg_inf"])
@pytest.mark.parametrize("rows,vocab", [(1, 102400), (4, 102400), (3, 98304), (2, 65537), (0, 65536), (64, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_argmax(kind, rows, vocab, dtype):
    x = rows_like(kind, rows, vocab, dtype, "cpu")
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.argmax(dim=-1))


def test_non_contiguous_rows():
    x = torch.randn(8, 1 << 16)[::2]  # rows 2^17 elements apart
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["random", "ties", "late_max", "nan", "neg_inf"])
@pytest.mark.parametrize("rows,vocab", [(1, 102400), (4, 102400), (64, 102400), (256, 129280), (2, 32001)])
def test_matches_torch_argmax_on_cuda(kind, rows, vocab):
    x = rows_like(kind, rows, vocab, torch.bfloat16, "cuda")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
