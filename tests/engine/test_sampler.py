"""Sampler tests against per-row float64 references written here, plus seeded-RNG statistics."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from encore.engine.sampler import (
    Sampler,
    SamplingTensors,
    StaticSamplingRows,
    apply_penalties,
    processed_probs,
    sample_from_probs,
    seeded_uniform,
)
from encore.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _build(params, *, seeds=None, counters=None, prompts=None, outputs=None,
           device=CPU) -> SamplingTensors:
    n = len(params)
    return SamplingTensors.build(
        params,
        seeds=list(range(100, 100 + n)) if seeds is None else seeds,
        counters=[0] * n if counters is None else counters,
        prompt_ids=[[] for _ in range(n)] if prompts is None else prompts,
        output_ids=[[] for _ in range(n)] if outputs is None else outputs,
        device=device,
    )


# ---- references: one row at a time, float64, written from the definitions ----

def _ref_penalties(row, prompt, output, p: SamplingParams) -> np.ndarray:
    out = np.array(row, dtype=np.float64)
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
    for tok in set(output):
        out[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _ref_filtered(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, top-k (ties kept), top-p (shortest prefix reaching top_p, ties kept), min-p."""
    x = np.asarray(row, dtype=np.float64) / (p.temperature if p.temperature > 0 else 1.0)
    keep = np.ones(len(x), dtype=bool)
    if 0 < p.top_k < len(x):
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    if p.top_p < 1.0:
        probs = np.where(keep, _softmax(np.where(keep, x, -np.inf)), 0.0)
        mass, last = 0.0, None
        for tok in sorted(np.flatnonzero(keep), key=lambda i: -x[i]):
            mass += probs[tok]
            last = x[tok]
            if mass >= p.top_p:
                break
        keep &= x >= last
    probs = np.where(keep, _softmax(np.where(keep, x, -np.inf)), 0.0)
    probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def _chi2_bound(df: int, z: float = 5.0) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 5 is a false-alarm rate of about 3e-7."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    support = probs > 0
    expected = probs[support] * counts.sum()
    return float((((counts[support] - expected) ** 2) / expected).sum()), int(support.sum()) - 1


# ---- SamplingTensors.build ----

def test_build_without_penalties_has_no_token_tensors():
    t = _build([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=3)])
    assert t.prompt_tokens is None and t.output_tokens is None
    assert t.max_logprobs is None and t.all_greedy
    assert t.temperature.dtype == torch.float32 and t.top_k.dtype == torch.int64
    assert t.seeds.dtype == torch.int64 and t.counters.dtype == torch.int64
    assert t.top_k.tolist() == [0, 3]


def test_build_output_tokens_only_for_presence_and_frequency():
    params = [SamplingParams(presence_penalty=0.5), SamplingParams(temperature=0.0, logprobs=0)]
    t = _build(params, prompts=[[1, 2], [3]], outputs=[[4, 4, 5], []])
    assert t.prompt_tokens is None
    assert t.output_tokens.tolist() == [[4, 4, 5], [-1, -1, -1]]
    assert t.max_logprobs == 0 and not t.all_greedy


def test_build_repetition_penalty_pads_prompt_and_output():
    params = [SamplingParams(repetition_penalty=1.3, logprobs=2), SamplingParams(logprobs=5),
              SamplingParams(temperature=0.0)]
    t = _build(params, prompts=[[1], [2, 3, 4], []], outputs=[[], [5], []], counters=[0, 1, 7])
    assert t.prompt_tokens.tolist() == [[1, -1, -1], [2, 3, 4], [-1, -1, -1]]
    assert t.output_tokens.tolist() == [[-1], [5], [-1]]
    assert t.max_logprobs == 5 and not t.all_greedy
    assert t.counters.tolist() == [0, 1, 7]


def test_build_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="counters"):
        SamplingTensors.build([SamplingParams()], seeds=[1], counters=[0, 1], prompt_ids=[[]],
                              output_ids=[[]], device=CPU)


# ---- penalties and greedy ----

def _penalty_case():
    gen = torch.Generator().manual_seed(0)
    vocab = 20
    logits = torch.randn(5, vocab, generator=gen) * 3
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(presence_penalty=1.2, frequency_penalty=-0.3),
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, presence_penalty=-0.5, frequency_penalty=1.0),
    ]
    prompts = [[0, 1, 1, 2], [3, 4], [5], [6, 7, 8], [9, 10, 0]]
    outputs = [[11, 11], [3, 12, 12, 12], [5, 13, 13], [14], [9, 9, 15, 16]]
    return logits, params, prompts, outputs


def test_penalties_match_reference():
    logits, params, prompts, outputs = _penalty_case()
    t = _build(params, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, t)
    for i, p in enumerate(params):
        want = _ref_penalties(logits[i].tolist(), prompts[i], outputs[i], p)
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, logits)


def test_presence_and_frequency_without_prompt_tensor():
    logits, _, prompts, outputs = _penalty_case()
    params = [SamplingParams(presence_penalty=0.8, frequency_penalty=0.2)] * len(prompts)
    t = _build(params, prompts=prompts, outputs=outputs)
    assert t.prompt_tokens is None
    got = apply_penalties(logits, t)
    for i, p in enumerate(params):
        np.testing.assert_allclose(got[i].numpy(), _ref_penalties(logits[i].tolist(), [], outputs[i], p),
                                   rtol=1e-6, atol=1e-6)


def test_no_penalties_leave_logits_unchanged():
    logits = torch.randn(3, 11, dtype=torch.bfloat16)
    got = apply_penalties(logits, _build([SamplingParams()] * 3))
    assert got.dtype == torch.float32 and torch.equal(got, logits.float())


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, _build([SamplingParams(temperature=0.0, top_k=3)] * 6))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


def test_greedy_uses_penalized_logits():
    logits, params, prompts, outputs = _penalty_case()
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=p.repetition_penalty,
                             presence_penalty=p.presence_penalty,
                             frequency_penalty=p.frequency_penalty) for p in params]
    for i, output in enumerate(outputs):  # make a seen token the raw winner by a small margin
        logits[i, output[0]] = logits[i].max() + 0.1
    out = Sampler()(logits, _build(greedy, prompts=prompts, outputs=outputs))
    want = [int(np.argmax(_ref_penalties(logits[i].tolist(), prompts[i], outputs[i], p)))
            for i, p in enumerate(greedy)]
    assert out.token_ids.tolist() == want
    assert sum(w != raw for w, raw in zip(want, logits.argmax(dim=-1).tolist())) >= 3


# ---- filtering ----

def _assert_probs(row: list[float], p: SamplingParams, want: np.ndarray | None = None):
    logits = torch.tensor([row], dtype=torch.float32)
    got = processed_probs(logits, _build([p]))[0].double().numpy()
    want = _ref_filtered(np.array(row), p) if want is None else want
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_filters_match_reference_on_random_rows():
    gen = torch.Generator().manual_seed(2)
    cases = [SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(top_k=5),
             SamplingParams(top_p=0.7), SamplingParams(temperature=1.7, top_p=0.3),
             SamplingParams(min_p=0.1), SamplingParams(top_k=10, top_p=0.8, min_p=0.05),
             SamplingParams(temperature=0.8, top_k=3, min_p=0.5), SamplingParams(top_k=1)]
    logits = torch.randn(len(cases), 64, generator=gen) * 2
    got = processed_probs(logits, _build(cases))
    for i, p in enumerate(cases):
        np.testing.assert_allclose(got[i].double().numpy(), _ref_filtered(logits[i].double().numpy(), p),
                                   atol=1e-6, err_msg=str(p))


def test_filters_that_no_row_uses_are_skipped_with_the_same_result():
    """Without top-k / top-p (or min-p) in any stochastic row, their ops are skipped: the probabilities
    are those of the full path bit for bit, -inf logits (a grammar's mask) included."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=gen) * 3
    logits[1, ::7] = float("-inf")
    plain = [SamplingParams(temperature=0.7), SamplingParams(), SamplingParams(temperature=1.3),
             SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)]  # greedy: its filters never count
    t = _build(plain)
    assert not t.truncates and not t.uses_min_p
    full = dataclasses.replace(t, uses_top_k=True, uses_top_p=True, uses_min_p=True)
    assert torch.equal(processed_probs(logits, t), processed_probs(logits, full))
    assert _build([SamplingParams(top_k=5)]).truncates and _build([SamplingParams(top_p=0.9)]).truncates
    top_k, top_p = _build([SamplingParams(top_k=5)]), _build([SamplingParams(top_p=0.9)])
    assert (top_k.uses_top_k, top_k.uses_top_p, top_p.uses_top_k, top_p.uses_top_p) == (True, False, False, True)
    assert not _build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)]).uses_top_k  # greedy rows never count
    assert _build([SamplingParams(min_p=0.1)]).uses_min_p and not _build([SamplingParams(min_p=0.1)]).truncates


@pytest.mark.parametrize("truncates", [False, True])
def test_the_static_layout_reads_back_as_build_lays_rows_out(truncates):
    """The stochastic heads and draft graphs (engine/head_graphs.py) read their rows' parameters from
    ``StaticSamplingRows``, laid out by ``penalty_free_rows`` and read through ``in_buffers``: the same
    distributions as ``build``'s tensors bit for bit (min-p always applied; top-k and top-p only in the
    variant that truncates, which serves steps where a row does), the same seeds and counters, and slots
    past the rows greedy (one-hot at their argmax), also after a wider graph's rows filled the buffers.
    More slots than the buffers hold is an error that names both."""
    gen = torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=0.7), SamplingParams(),
              SamplingParams(temperature=1.2, min_p=0.1), SamplingParams(temperature=0.0, top_p=0.5)]
    if truncates:
        params.append(SamplingParams(temperature=0.9, top_k=7, top_p=0.8))
    seeds, counters = [2**40 + 3, -5, 17, 0, 99][:len(params)], [0, 4, 9, 2, 31][:len(params)]
    slots = len(params) + 2
    logits = torch.randn(slots, 200, generator=gen) * 3
    buffers = StaticSamplingRows(slots + 3, CPU)
    buffers.write([(SamplingParams(temperature=0.5, top_p=0.3, min_p=0.2), 1, 1)] * (slots + 3), slots + 3)
    buffers.write(list(zip(params, seeds, counters)), slots)
    t = buffers.tensors(slots, truncates)
    want = _build(params, seeds=seeds, counters=counters)
    assert want.truncates == truncates
    got = processed_probs(logits, t)
    assert torch.equal(got[:len(params)], processed_probs(logits[:len(params)], want))
    greedy = torch.zeros(2, 200).scatter_(1, logits[len(params):].argmax(dim=-1, keepdim=True), 1.0)
    assert torch.equal(got[len(params):], greedy)
    assert t.seeds[:len(params)].tolist() == seeds and t.counters[:len(params)].tolist() == counters
    assert torch.equal(t.top_k[:len(params)], want.top_k) and torch.equal(t.top_p[:len(params)], want.top_p)
    with pytest.raises(ValueError, match=f"in {slots + 4} slots: the buffers hold {slots + 3}"):
        buffers.write([], slots + 4)


def test_top_k_keeps_ties_and_off_values():
    row = [3.0, 2.0, 2.0, 1.0, 0.0]
    _assert_probs(row, SamplingParams(top_k=2))
    assert np.count_nonzero(_ref_filtered(np.array(row), SamplingParams(top_k=2))) == 3
    full = _softmax(np.array(row))
    for k in (0, 5, 9):  # off, == V, > V
        _assert_probs(row, SamplingParams(top_k=k), full)


def test_top_p_prefix_and_ties():
    row = np.log([0.5, 0.2, 0.2, 0.1]).tolist()
    _assert_probs(row, SamplingParams(top_p=0.49), np.array([1.0, 0, 0, 0]))
    _assert_probs(row, SamplingParams(top_p=0.51), np.array([5 / 9, 2 / 9, 2 / 9, 0]))  # tie kept
    _assert_probs(row, SamplingParams(top_p=0.95), np.array([0.5, 0.2, 0.2, 0.1]))


def test_top_p_boundary_is_reached_not_exceeded():
    row = [0.0, -1e-10, -40.0]  # float32 probabilities exactly [0.5, 0.5, ~0] with no tie
    _assert_probs(row, SamplingParams(top_p=0.5), np.array([1.0, 0, 0]))


def test_top_p_below_float32_keeps_the_top_token():
    row = np.log([0.5, 0.2, 0.2, 0.1]).tolist()
    _assert_probs(row, SamplingParams(top_p=1e-50), np.array([1.0, 0, 0, 0]))  # 0 in the float32 column


def test_top_p_one_keeps_tiny_tail():
    row = [0.0, -30.0, -float("inf")]  # the tail is below float32 rounding of the cumulative mass
    got = processed_probs(torch.tensor([row]), _build([SamplingParams(top_p=1.0)]))[0]
    assert got[1] > 0 and got[2] == 0


def test_min_p():
    row = np.log([0.5, 0.3, 0.15, 0.05]).tolist()
    _assert_probs(row, SamplingParams(min_p=0.25), np.array([0.5, 0.3, 0.15, 0]) / 0.95)
    _assert_probs(row, SamplingParams(min_p=1.0), np.array([1.0, 0, 0, 0]))


def test_processed_probs_greedy_rows_are_one_hot():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(3))
    probs = processed_probs(logits, _build([SamplingParams(temperature=0.0), SamplingParams(),
                                            SamplingParams(temperature=0.0, top_p=0.1)]))
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 10).float())
    assert torch.equal(probs[2], torch.nn.functional.one_hot(logits[2].argmax(), 10).float())
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], dim=-1))


# ---- seeded sampling ----

def _row_params():
    return [SamplingParams(seed=1), SamplingParams(temperature=0.7, top_k=20, seed=2),
            SamplingParams(top_p=0.8, seed=3), SamplingParams(temperature=0.0),
            SamplingParams(min_p=0.05, temperature=1.3, repetition_penalty=1.1, seed=5)]


def test_seeded_tokens_ignore_batch_composition_and_order():
    gen = torch.Generator().manual_seed(4)
    vocab = 300
    logits = torch.randn(5, vocab, generator=gen)
    params, seeds, counters = _row_params(), [11, 22, 33, 44, 55], [0, 3, 9, 2, 17]
    prompts, outputs = [[1], [2], [3], [4], [5, 6]], [[], [7], [], [8], [9, 9]]
    base = Sampler()(logits, _build(params, seeds=seeds, counters=counters, prompts=prompts,
                                    outputs=outputs)).token_ids

    order = [3, 0, 4, 2, 1]
    extra = torch.randn(3, vocab, generator=gen)
    mixed_logits = torch.cat([extra[:1], logits[order], extra[1:]])

    def pick(rows: list, fill: list) -> list:  # extra row, the permuted rows, two extra rows
        return [fill[0]] + [rows[i] for i in order] + fill[1:]

    mixed = Sampler()(mixed_logits, _build(
        pick(params, [SamplingParams(), SamplingParams(top_k=4), SamplingParams(repetition_penalty=0.5)]),
        seeds=pick(seeds, [7, 8, 9]), counters=pick(counters, [1, 2, 3]),
        prompts=pick(prompts, [[1], [2], [3]]), outputs=pick(outputs, [[4], [], [5]]))).token_ids
    assert mixed[1:6].tolist() == base[order].tolist()


def test_different_seeds_and_counters_draw_differently():
    n, vocab = 200, 1000
    flat = torch.zeros(n, vocab)
    by_seed = Sampler()(flat, _build([SamplingParams()] * n, seeds=list(range(n)))).token_ids
    by_counter = Sampler()(flat, _build([SamplingParams()] * n, seeds=[5] * n,
                                        counters=list(range(n)))).token_ids
    # 200 uniform draws from 1000 give ~181 distinct values; identical streams would give 1
    assert len(set(by_seed.tolist())) > 160 and len(set(by_counter.tolist())) > 160
    assert not torch.equal(by_seed, by_counter)


def test_seeded_draws_follow_processed_probs():
    """Chi-square of 20000 seeded draws per row distribution against processed_probs."""
    draws, vocab = 20000, 12
    gen = torch.Generator().manual_seed(5)
    cases = [SamplingParams(), SamplingParams(temperature=0.6, top_k=6),
             SamplingParams(top_p=0.85, min_p=0.02, temperature=1.5)]
    base = torch.randn(len(cases), vocab, generator=gen)
    params = [p for p in cases for _ in range(draws)]
    logits = base.repeat_interleave(draws, dim=0)
    # case 0 varies the counter under one seed, the others vary the seed
    seeds = [9] * draws + list(range(2 * draws))
    counters = list(range(draws)) + [4] * (2 * draws)
    t = _build(params, seeds=seeds, counters=counters)
    tokens = Sampler()(logits, t).token_ids.view(len(cases), draws)
    probs = processed_probs(base, _build(cases)).double().numpy()
    for i in range(len(cases)):
        counts = np.bincount(tokens[i].numpy(), minlength=vocab).astype(np.float64)
        assert counts[probs[i] == 0].sum() == 0, "a filtered-out token was sampled"
        stat, df = _chi2(counts, probs[i])
        assert stat < _chi2_bound(df), (i, stat, df)
        # power check: the same counts reject a mildly wrong distribution
        wrong = _softmax(np.log(np.where(probs[i] > 0, probs[i], 1e-300)) * 1.15)
        assert _chi2(counts, wrong)[0] > _chi2_bound(df), i


def test_sample_from_probs_salt_changes_draws_and_respects_support():
    n = 500
    probs = torch.full((n, 50), 1.0)
    probs[:, 10:] = 0.0
    seeds, counters = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    a = sample_from_probs(probs, seeds, counters)
    b = sample_from_probs(probs, seeds, counters, salt=1)
    assert a.max() < 10 and b.max() < 10
    assert (a != b).float().mean() > 0.8
    assert torch.equal(a, sample_from_probs(probs, seeds, counters))


# ---- seeded_uniform ----

def _grid(n_rows=1000, n_cols=1000):
    seeds = torch.arange(n_rows, dtype=torch.int64) * 0x9E3779B97F4A7  # spread over ~62 bits
    counters = torch.arange(n_rows, dtype=torch.int64) % 7
    return seeds, counters, seeded_uniform(seeds, counters, n_cols)


def test_seeded_uniform_in_open_interval_and_uniform():
    _, _, u = _grid()
    assert u.dtype == torch.float32 and u.shape == (1000, 1000)
    assert u.min() > 0 and u.max() < 1
    x = np.sort(u.double().flatten().numpy())
    n = len(x)
    ecdf_hi = np.arange(1, n + 1) / n
    ks = max(np.max(ecdf_hi - x), np.max(x - (ecdf_hi - 1 / n)))
    assert ks < math.sqrt(math.log(2 / 1e-6) / (2 * n)), ks  # Kolmogorov-Smirnov, alpha = 1e-6


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.corrcoef(a.double().flatten().numpy(), b.double().flatten().numpy())[0, 1])


def test_seeded_uniform_decorrelated():
    seeds, counters, u = _grid()
    bound = 5 / math.sqrt(u.numel())
    assert abs(_corr(u[:, :-1], u[:, 1:])) < bound  # adjacent columns
    assert abs(_corr(u, seeded_uniform(seeds, counters + 1, 1000))) < bound  # next counter
    assert abs(_corr(u, seeded_uniform(seeds + 1, counters, 1000))) < bound  # next seed
    assert abs(_corr(u, seeded_uniform(seeds, counters, 1000, salt=1))) < bound  # other salt


def _ref_mix32(h: int, s1: int, m1: int, s2: int, m2: int, s3: int) -> int:
    h ^= h >> s1
    h = (h * m1) & 0xFFFFFFFF
    h ^= h >> s2
    h = (h * m2) & 0xFFFFFFFF
    return h ^ (h >> s3)


def _ref_uniform(seed: int, counter: int, column: int, salt: int) -> float:
    """The documented hash with Python integers: two keyed rounds of murmur3 / lowbias32."""
    murmur3, lowbias32 = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16), (16, 0x7FEB352D, 15, 0x846CA68B, 16)
    key1, key2 = 0x243F6A88, 0x13198A2E
    for word in (seed & 0xFFFFFFFF, seed >> 32, counter & 0xFFFFFFFF, counter >> 32, salt):
        key1, key2 = _ref_mix32(key1 ^ word, *murmur3), _ref_mix32(key2 ^ word, *lowbias32)
    h = _ref_mix32(_ref_mix32(column ^ key1, *lowbias32) ^ key2, *murmur3)
    return ((h >> 9) * 2 + 1) / 2**24


def test_seeded_uniform_matches_python_hash():
    seeds = [0, 1, 2**32 + 1, 2**63 - 1, 123456789012345]
    counters = [0, 5, 2**32, 1, 2**40 + 3]
    for salt in (0, 3):
        u = seeded_uniform(torch.tensor(seeds), torch.tensor(counters), 40, salt=salt)
        want = [[_ref_uniform(s, c, j, salt) for j in range(40)] for s, c in zip(seeds, counters)]
        assert u.tolist() == want


def test_seeded_uniform_depends_only_on_own_row():
    seeds = torch.tensor([3, 3 + 2**32, 2**62 + 5, 3], dtype=torch.int64)
    counters = torch.tensor([0, 0, 2**33, 1], dtype=torch.int64)
    u = seeded_uniform(seeds, counters, 64, salt=7)
    for i in range(4):
        assert torch.equal(u[i], seeded_uniform(seeds[i:i + 1], counters[i:i + 1], 64, salt=7)[0])
    assert torch.equal(u[[3, 1]], seeded_uniform(seeds[[3, 1]], counters[[3, 1]], 64, salt=7))
    # high bits of seed and counter matter
    assert len({tuple(row.tolist()) for row in u}) == 4
    high = seeded_uniform(torch.tensor([3, 3]), torch.tensor([1, 1 + 2**32]), 64)
    assert not torch.equal(high[0], high[1])


# ---- logprobs ----

def test_logprobs_are_raw_model_logprobs():
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(4, 40, generator=gen) * 2).to(torch.bfloat16)
    params = [SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.4, seed=1),
              SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(logprobs=1, top_k=2), SamplingParams(logprobs=0, top_p=0.5)]
    out = Sampler()(logits, _build(params, prompts=[[0, 1]] * 4, outputs=[[2, 3]] * 4))
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (4,)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (4, 3) and out.top_ids.dtype == torch.int64
    want = raw.sort(dim=-1, descending=True)
    torch.testing.assert_close(out.top_logprobs, want.values[:, :3])
    torch.testing.assert_close(raw.gather(1, out.top_ids), want.values[:, :3])


def test_logprobs_zero_and_none_shapes():
    logits = torch.randn(2, 8)
    zero = Sampler()(logits, _build([SamplingParams(logprobs=0), SamplingParams()]))
    assert zero.logprobs.shape == (2,) and zero.top_ids.shape == (2, 0) and zero.top_logprobs.shape == (2, 0)
    none = Sampler()(logits, _build([SamplingParams(), SamplingParams(temperature=0.0)]))
    assert none.logprobs is None and none.top_ids is None and none.top_logprobs is None
    wide = Sampler()(logits[:, :5], _build([SamplingParams(logprobs=20)] * 2))
    assert wide.top_ids.shape == (2, 5)  # capped at the vocabulary


# ---- mixed batch ----

def test_mixed_greedy_and_stochastic_batch():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 100, generator=gen)
    params = _row_params()
    prompts, outputs = [[1]] * 5, [[2, 2]] * 5
    t = _build(params, prompts=prompts, outputs=outputs, counters=[0, 1, 2, 3, 4])
    assert not t.all_greedy
    tokens = Sampler()(logits, t).token_ids
    probs = processed_probs(logits, t)
    assert torch.equal(tokens, sample_from_probs(probs, t.seeds, t.counters))
    assert (probs.gather(1, tokens[:, None]) > 0).all()
    greedy_row = _ref_penalties(logits[3].tolist(), prompts[3], outputs[3], params[3])
    assert tokens[3] == int(np.argmax(greedy_row))


# ---- CUDA: no host synchronization ----

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_does_not_sync_on_cuda():
    cuda = torch.device("cuda")
    params = _row_params() + [SamplingParams(logprobs=4, top_k=7, top_p=0.9, frequency_penalty=0.3)]
    n = len(params)
    logits = torch.randn(n, 32000, device=cuda, dtype=torch.bfloat16)
    t = _build(params, prompts=[[1, 2, 3]] * n, outputs=[[4, 4]] * n, counters=list(range(n)), device=cuda)
    sampler = Sampler()
    sampler(logits, t)  # warm up kernels and allocator outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # building the tensors too: the step builds them while the device runs its forward
        t = _build(params, prompts=[[1, 2, 3]] * n, outputs=[[4, 4]] * n, counters=list(range(n)), device=cuda)
        out = sampler(logits, t)
        probs = processed_probs(logits, t)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu_t = _build(params, prompts=[[1, 2, 3]] * n, outputs=[[4, 4]] * n, counters=list(range(n)))
    assert torch.equal(seeded_uniform(t.seeds, t.counters, 1000).cpu(),
                       seeded_uniform(cpu_t.seeds, cpu_t.counters, 1000))  # same bits on both devices
    assert (probs.gather(1, out.token_ids[:, None]) > 0).all()
