"""Top-k / top-p thresholds without a sort (backends/truncation_triton.py) against the sort of
``sampler.truncated_by_sort``: the same kept tokens in every row, over rows that truncate by top-k,
top-p, both or neither, ties, -inf logits (a grammar's mask), flat rows and rows of one chunk or many.
Without CUDA the kernels run in Triton's interpreter (``triton_interpreter.py``); ``-m gpu`` runs
them compiled, at V2-Lite's vocabulary, against float64."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import in_process, rerun_in_child  # before anything imports triton

from encore.backends.truncation_triton import truncation_thresholds
from encore.engine.sampler import truncated_by_sort

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kept(x: torch.Tensor, top_k: list[int], top_p: list[float], uses_top_k: bool = True, uses_top_p: bool = True):
    """(the kernels' truncated logits, the sort's) for rows ``x`` [N, V] and their filters."""
    k = torch.tensor(top_k, dtype=torch.int64, device=DEVICE)
    p = torch.tensor(top_p, dtype=torch.float32, device=DEVICE)
    tau = truncation_thresholds(x, k, p, uses_top_k, uses_top_p)
    assert tau.shape == (x.shape[0],) and tau.dtype == torch.float32
    return x.masked_fill(x < tau[:, None], float("-inf")), truncated_by_sort(x, k, p)


def logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * scale).to(DEVICE)


@in_process
@pytest.mark.parametrize("vocab", [7, 300, 5000])  # one chunk a row, part of a tile or more; five chunks
def test_keeps_the_sorts_tokens(vocab):
    x = logits(7, vocab, seed=vocab)
    top_k = [0, 50, 1, vocab, 7, vocab + 9, -1]
    top_p = [0.9, 0.95, 1.0, 0.5, 1.0, 0.2, 0.999]
    got, want = kept(x, top_k, top_p)
    assert torch.equal(got, want)
    counts = (got > float("-inf")).sum(-1).tolist()
    assert counts[2] == 1 and counts[4] == 7 and counts[3] < vocab  # top-k alone; top-k all, top-p 0.5


@in_process
def test_ties_with_the_threshold_are_kept():
    """Logits rounded to integers: every cut lands among equal logits, all of which are kept."""
    x = logits(5, 3000, seed=1, scale=2.0).round()
    got, want = kept(x, [0, 50, 1, 3000, 7], [0.9, 0.95, 1.0, 0.5, 1.0])
    assert torch.equal(got, want)
    assert (got[2] > float("-inf")).sum() == (x[2] == x[2].max()).sum() > 1  # top-k 1 keeps the max's ties


@in_process
def test_minus_inf_logits_take_no_part():
    """A third of each row masked to -inf (a grammar's mask), top-k past the finite logits included; a
    row with one finite logit, and one with none (the search ends; softmax then makes it NaN, as torch's)."""
    x = logits(7, 3000, seed=2)
    x[:, ::3] = float("-inf")
    x[5:] = float("-inf")
    x[5, 1] = 2.0
    got, want = kept(x, [0, 2000, 1, 1500, 0, 3, 5], [0.99, 0.95, 0.3, 1.0, 0.999, 0.5, 0.9])
    assert torch.equal(got, want)
    assert (got[5] > float("-inf")).sum() == 1


@in_process
def test_top_p_below_float32_keeps_the_top_tokens():
    """A top_p that rounds to 0 in float32 (1e-50), and the least positive one: the top token and its
    ties are kept, as the sort keeps them."""
    x = logits(3, 3000, seed=3, scale=2.0).round()
    got, want = kept(x, [0, 0, 5], [1e-50, 1e-45, 1e-50])
    assert torch.equal(got, want)
    assert ((got > float("-inf")).sum(-1) == (x == x.max(-1, keepdim=True).values).sum(-1)).all()


@in_process
def test_flat_rows_keep_every_token():
    got, want = kept(torch.zeros(3, 1500, device=DEVICE), [0, 10, 1], [0.5, 0.9, 1.0])
    assert torch.equal(got, want) and (got == 0).all()


@in_process
def test_a_phase_no_row_needs_is_not_launched():
    """``uses_top_k=False`` launches only top-p's phase, ``uses_top_p=False`` only top-k's, neither
    none (the caller passes them from its rows' filters: the filter is then off in every row)."""
    x = logits(3, 4000, seed=3, scale=0.5)
    got, want = kept(x, [0, 0, 0], [0.9, 0.3, 1.0], uses_top_k=False)
    assert torch.equal(got, want) and (got[2] > float("-inf")).all()
    got, want = kept(x, [10, 0, 2500], [1.0, 1.0, 1.0], uses_top_p=False)
    assert torch.equal(got, want) and (got[0] > float("-inf")).sum() == 10
    none = truncation_thresholds(x, torch.zeros(3, dtype=torch.int64, device=DEVICE), torch.ones(3, device=DEVICE),
                                 False, False)
    assert torch.equal(none, torch.full((3,), float("-inf"), device=DEVICE))


@in_process
def test_the_same_thresholds_on_every_run():
    x = logits(4, 3000, seed=4, scale=0.3)
    k = torch.tensor([0, 100, 0, 5], device=DEVICE)
    p = torch.tensor([0.9, 0.7, 0.95, 1.0], device=DEVICE)
    assert torch.equal(truncation_thresholds(x, k, p, True, True), truncation_thresholds(x, k, p, True, True))


@in_process
def test_rows_must_be_contiguous_float32():
    x = logits(4, 64, seed=5)
    k, p = torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.full((4,), 0.5, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous columns; x has strides"):
        truncation_thresholds(x.t(), k, p, True, True)
    with pytest.raises(ValueError, match="float32 logits; x is torch.float16"):
        truncation_thresholds(x.half(), k, p, True, True)


def assert_cuts_in_float64(x: torch.Tensor, top_k: list[int], top_p: list[float], tau: torch.Tensor) -> None:
    """Each row's kept set {x >= tau}, checked in float64: its smallest logit at or above the row's k-th
    largest (equal to it with top-p off), and with top-p on the shortest prefix whose mass reaches
    top_p, to within 1e-6 of the top-k mass (the kernels sum in float32)."""
    vocab = x.shape[1]
    for row, k, p, t in zip(x.double(), top_k, top_p, tau.double().tolist()):
        kth = row.topk(k if 0 < k < vocab else vocab).values[-1]
        smallest = row[row >= t].min()
        if p >= 1.0:
            assert smallest == kth
            continue
        assert smallest >= kth
        mass = torch.exp(row - row.max())
        top_k_mass = mass[row >= kth].sum()
        above, at_or_above = mass[row > smallest].sum() / top_k_mass, mass[row >= smallest].sum() / top_k_mass
        assert above < p + 1e-6 and at_or_above > p - 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, 64, 200])
@pytest.mark.parametrize("scale", [0.3, 3.0])  # flat rows (top-p keeps most tokens) and peaked ones
def test_cuts_where_float64_does_on_cuda(rows, scale):
    """At V2-Lite's vocabulary, against float64 rather than the float32 sort: over tens of thousands of
    kept tokens the sort's float32 cumsum is itself off by ~1e-5 of the mass (on an H200 the two cut
    one token apart in 14 of 200 flat rows; in each of the rows checked, float64 cut where the kernels
    did)."""
    x = logits(rows, 102400, seed=rows, scale=scale)
    x[::3, ::5] = float("-inf")
    gen = torch.Generator().manual_seed(rows)
    top_k = torch.randint(-5, 2000, (rows,), generator=gen).tolist()
    top_k[0] = 0
    top_p = (torch.rand(rows, generator=gen) * 1.2).clamp(0.01, 1.0).tolist()
    for uses_top_k in (True, False):
        k = top_k if uses_top_k else [0] * rows
        tau = truncation_thresholds(x, torch.tensor(k, device=DEVICE), torch.tensor(top_p, device=DEVICE), uses_top_k,
                                    True)
        assert_cuts_in_float64(x, k, top_p, tau)


test_cpu_tests_in_child_process = rerun_in_child(__file__)
