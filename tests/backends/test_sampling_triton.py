"""The sampler's kernels (backends/sampling_triton.py) against the torch formulations they replace on CUDA.
The exponential race: the same token for every row, bit for bit in the draw, over vocabularies that do
and do not fill whole blocks and chunks, extreme seeds and counters, salts, ties and zero
probabilities. The uniforms: the torch hash's values bit for bit. The softmax of few wide rows:
torch's softmax within float32 rounding, -inf entries and all -inf rows included. Without CUDA the
kernels run in Triton's interpreter (``triton_interpreter.py``); ``-m gpu`` runs them compiled, at
V2-Lite's vocabulary and in bfloat16."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import in_process, rerun_in_child  # before anything imports triton

from encore.backends.argmax_triton import split
from encore.backends.sampling_triton import _PROGRAMS, exponential_race, seeded_uniforms, softmax_rows
from encore.engine.sampler import seeded_uniform

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_uniform(seeds: torch.Tensor, counters: torch.Tensor, n: int, salt: int) -> torch.Tensor:
    """The torch hash ``sampler.seeded_uniform`` runs off CUDA (computed on the CPU, on CUDA it is the kernel's)."""
    return seeded_uniform(seeds.cpu(), counters.cpu(), n, salt).to(seeds.device)


def reference(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, salt: int) -> torch.Tensor:
    """The torch race ``sampler.sample_from_probs`` runs off CUDA."""
    u = torch_uniform(seeds, counters, probs.shape[1], salt)
    return (probs.float() / -torch.log(u)).argmax(dim=-1)


def draw_inputs(rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, dim=-1).to(DEVICE, dtype)
    seeds = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen).to(DEVICE)
    counters = torch.randint(0, 2**40, (rows,), generator=gen).to(DEVICE)
    return probs, seeds, counters


def test_race_chunks():
    assert split(1, 102400, _PROGRAMS) == (100, 1024)
    assert split(64, 102400, _PROGRAMS) == (8, 13312)


@in_process
@pytest.mark.parametrize("rows, vocab", [(1, 102400), (3, 5000), (64, 3000), (2, 1024), (5, 7)])
@pytest.mark.parametrize("salt", [0, 7])
def test_matches_the_torch_race(rows, vocab, salt):
    probs, seeds, counters = draw_inputs(rows, vocab, seed=rows * 31 + vocab + salt)
    got = exponential_race(probs, seeds, counters, salt)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, reference(probs, seeds, counters, salt))


@in_process
def test_strided_seeds_and_counters_are_read_row_by_row():
    """A verify step passes each row's seed and counter as every (1 + k)-th entry of its per-position
    lists (``t.seeds[::q_len]``): views whose rows are not adjacent."""
    probs, seeds, counters = draw_inputs(4, 3000, seed=5)
    spread = [torch.zeros(12, dtype=torch.int64, device=DEVICE) for _ in range(2)]
    spread[0][::3], spread[1][::3] = seeds, counters
    assert torch.equal(exponential_race(probs, spread[0][::3], spread[1][::3], 0), reference(probs, seeds, counters, 0))


@in_process
@pytest.mark.parametrize("rows, n", [(6, 1), (3, 3), (2, 2500), (1, 1024)])
@pytest.mark.parametrize("salt", [1, 0xFFFFFFFF + 5])
def test_uniforms_are_the_torch_hash_bit_for_bit(rows, n, salt):
    """One launch for ``seeded_uniform``: every value equal to the torch hash's, whole and partial blocks
    of columns, extreme seeds and counters, strided rows, a salt past 32 bits (its low 32 are used)."""
    _, seeds, counters = draw_inputs(rows, 8, seed=rows * 7 + n)
    seeds[0], counters[0] = -2**63, 2**63 - 1
    got = seeded_uniforms(seeds, counters, n, salt)
    want = torch_uniform(seeds, counters, n, salt)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert torch.equal(got, want)
    spread = torch.stack([seeds, counters, seeds]).t()  # [rows, 3]: rows of each column 3 apart
    assert torch.equal(seeded_uniforms(spread[:, 0], spread[:, 1], n, salt), want)


@in_process
def test_draws_depend_on_seed_counter_and_salt_only():
    probs, seeds, counters = draw_inputs(8, 3000, seed=1)
    base = exponential_race(probs, seeds, counters, 0)
    assert torch.equal(exponential_race(probs.flip(0), seeds.flip(0), counters.flip(0), 0), base.flip(0))
    assert torch.equal(exponential_race(probs[2:5], seeds[2:5], counters[2:5], 0), base[2:5])
    others = [exponential_race(probs, seeds, counters + 1, 0), exponential_race(probs, seeds, counters, 1)]
    assert all(not torch.equal(other, base) for other in others)


@in_process
def test_zeros_never_win_and_all_zero_rows_pick_the_first_column():
    vocab = 2500  # the hot columns sit in different chunks and blocks
    probs = torch.zeros(4, vocab, device=DEVICE)
    probs[0, 2047] = 1.0
    probs[1, [5, 2400]] = 0.5
    probs[2, vocab - 1] = 1e-30
    seeds, counters = torch.arange(4, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)
    got = exponential_race(probs, seeds, counters, 0)
    assert got[0] == 2047 and got[1] in (5, 2400) and got[2] == vocab - 1 and got[3] == 0
    assert torch.equal(got, reference(probs, seeds, counters, 0))


@in_process
def test_rows_must_be_contiguous():
    probs, seeds, counters = draw_inputs(4, 64, seed=2)
    with pytest.raises(ValueError, match="contiguous columns"):
        exponential_race(probs.t(), seeds[:4], counters[:4], 0)


@in_process
@pytest.mark.parametrize("rows, vocab", [(1, 102400), (3, 5000), (64, 3000), (2, 1024), (5, 7)])
def test_softmax_matches_torch(rows, vocab):
    gen = torch.Generator().manual_seed(rows + vocab)
    x = (torch.randn(rows, vocab, generator=gen) * 4).to(DEVICE)
    x[0, ::3] = float("-inf")  # masked tokens, as top-k / top-p leave them
    got = softmax_rows(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, torch.softmax(x, dim=-1), rtol=1e-5, atol=1e-7)
    assert (got[0, ::3] == 0).all()


@in_process
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # numpy's -inf - -inf
def test_softmax_of_a_row_of_minus_inf_is_nan_as_torch():
    x = torch.zeros(3, 2100, device=DEVICE)
    x[1] = float("-inf")
    x[2, :1500] = float("-inf")  # whole chunks of -inf before the row's values
    got = softmax_rows(x)
    assert torch.isnan(got[1]).all() and not torch.isnan(got[[0, 2]]).any()
    torch.testing.assert_close(got[[0, 2]], torch.softmax(x[[0, 2]], dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_torch_on_cuda(rows, dtype):
    probs, seeds, counters = draw_inputs(rows, 102400, seed=rows, dtype=dtype)
    for salt in (0, 3):
        assert torch.equal(exponential_race(probs, seeds, counters, salt), reference(probs, seeds, counters, salt))
    x = probs.float().log()
    torch.testing.assert_close(softmax_rows(x), torch.softmax(x, dim=-1), rtol=1e-5, atol=1e-8)


test_cpu_tests_in_child_process = rerun_in_child(__file__)
