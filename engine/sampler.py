"""Batched token sampling without host synchronization.

``Sampler`` turns one step's logits rows into token ids: penalties, then greedy argmax for
``temperature == 0`` rows and, for the others, temperature, top-k, top-p and min-p followed by an
exponential race (``argmax(p / E)``, ``E ~ Exp(1)``). The random numbers come from
``seeded_uniform``, a counter-based hash of ``(seed, counter, column, salt)``, so a row's draw
depends only on its request's seed and the index of the token being sampled — never on which other
rows share the batch or where the row sits — and no ``torch.Generator`` or host read is needed
(the whole call is CUDA-graph capturable). Every Python-level choice (is any row stochastic, are
penalties or logprobs needed) is made on the host in ``SamplingTensors.build``.

Filter semantics (all ties kept, so results never depend on sort order):

- top-k keeps every token whose logit is >= the k-th largest (``top_k == 0`` or ``>= V``: all);
- top-p, on the renormalized top-k distribution, keeps the shortest prefix of tokens sorted by
  probability whose mass reaches ``top_p`` plus every token tied with its last one
  (``top_p == 1``: all);
- min-p keeps tokens with ``p >= min_p * max(p)``; the survivors are renormalized.

The pieces are module functions because speculative decoding needs target probabilities
(``processed_probs``), acceptance uniforms (``seeded_uniform`` with its own salt) and seeded draws
from residual distributions (``sample_from_probs``) separately.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from encore.backends.argmax import argmax_rows
from encore.backends.host_tensors import host_tensor, upload
from encore.engine.sampling_params import SamplingParams

SAMPLE_SALT = 0  # salt of the draw in Sampler; other users of seeded_uniform pick other salts

_MASK32 = 0xFFFFFFFF
# 32-bit finalizers (shift, multiplier, shift, multiplier, shift): murmur3's fmix32 and
# C. Wellons' lowbias32. Two different mixers give the two row keys independent-looking values.
_MURMUR3 = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)
_LOWBIAS32 = (16, 0x7FEB352D, 15, 0x846CA68B, 16)


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one step; one row per logits row, all on the logits' device.

    ``prompt_tokens`` is present only when some row has ``repetition_penalty != 1`` and
    ``output_tokens`` only when some row uses any penalty; both are padded with -1.
    ``counters`` is the index of the token being sampled within its request (0 for the first
    output token). ``max_logprobs`` is the largest top-n requested (None: no row wants logprobs).
    ``uses_top_k`` / ``uses_top_p`` / ``uses_min_p``: some stochastic row has that filter on (off,
    ``_filtered_probs`` skips the filter's ops, whose result would be the same); ``truncates``: top-k
    or top-p.
    """

    temperature: torch.Tensor  # [N] float32 (0 = greedy)
    top_p: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64 (0 = off)
    min_p: torch.Tensor  # [N] float32
    repetition_penalty: torch.Tensor  # [N] float32
    presence_penalty: torch.Tensor  # [N] float32
    frequency_penalty: torch.Tensor  # [N] float32
    seeds: torch.Tensor  # [N] int64
    counters: torch.Tensor  # [N] int64
    prompt_tokens: torch.Tensor | None  # [N, Lp] int64, -1 padded
    output_tokens: torch.Tensor | None  # [N, Lo] int64, -1 padded
    max_logprobs: int | None
    all_greedy: bool
    uses_top_k: bool
    uses_top_p: bool
    uses_min_p: bool

    @property
    def truncates(self) -> bool:
        return self.uses_top_k or self.uses_top_p

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int],
              prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
              device: torch.device) -> SamplingTensors:
        """Gather per-row values on the host, then copy them to ``device`` in one transfer."""
        n = len(params)
        lengths = {"seeds": len(seeds), "counters": len(counters),
                   "prompt_ids": len(prompt_ids), "output_ids": len(output_ids)}
        bad = {name: length for name, length in lengths.items() if length != n}
        if bad:
            raise ValueError(f"SamplingTensors.build got {n} params but lengths {bad}; "
                             "every list needs one entry per logits row")

        needs_prompt = any(p.repetition_penalty != 1.0 for p in params)
        needs_output = needs_token_history(params)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        # One host-to-device copy, split into per-field views on the device.
        history = {name: _padded(rows) for name, rows, needed in (("prompt", prompt_ids, needs_prompt),
                                                                  ("output", output_ids, needs_output)) if needed}
        floats, longs, *flat = upload([([p.temperature for p in params] + [p.top_p for p in params]
                                        + [p.min_p for p in params] + [p.repetition_penalty for p in params]
                                        + [p.presence_penalty for p in params]
                                        + [p.frequency_penalty for p in params], torch.float32),
                                       ([*seeds, *counters, *(p.top_k for p in params)], torch.int64),
                                       *((padded, torch.int64) for padded, _ in history.values())], device)
        floats, longs = floats.view(6, n), longs.view(3, n)
        tokens = {name: f.view(n, width) for (name, (_, width)), f in zip(history.items(), flat)}
        return cls(
            temperature=floats[0],
            top_p=floats[1],
            top_k=longs[2],
            min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            seeds=longs[0],
            counters=longs[1],
            prompt_tokens=tokens.get("prompt"),
            output_tokens=tokens.get("output"),
            max_logprobs=max(wanted) if wanted else None,
            all_greedy=all(p.greedy for p in params),
            uses_top_k=any(not p.greedy and p.top_k > 0 for p in params),
            uses_top_p=any(not p.greedy and p.top_p < 1.0 for p in params),
            uses_min_p=any(not p.greedy and p.min_p > 0.0 for p in params),
        )

    @staticmethod
    def penalty_free_rows(rows: Sequence[tuple[SamplingParams, int, int]], slots: int
                          ) -> tuple[list[float], list[int]]:
        """Host values of rows whose penalties are off ((params, seed, counter) each), padded with
        greedy rows to ``slots``, laid out as ``build`` lays them out: [6, slots] floats (temperature,
        top-p, min-p, then the penalties' neutral values) and [3, slots] longs (seed, counter, top-k).
        ``in_buffers`` reads them back on the device."""
        pad = slots - len(rows)
        floats = ([p.temperature for p, _, _ in rows] + [0.0] * pad + [p.top_p for p, _, _ in rows] + [1.0] * pad
                  + [p.min_p for p, _, _ in rows] + [0.0] * pad + [1.0] * slots + [0.0] * (2 * slots))
        longs = ([seed for _, seed, _ in rows] + [0] * pad + [counter for _, _, counter in rows] + [0] * pad
                 + [p.top_k for p, _, _ in rows] + [0] * pad)
        return floats, longs

    @classmethod
    def in_buffers(cls, floats: torch.Tensor, longs: torch.Tensor, truncates: bool) -> SamplingTensors:
        """The rows ``penalty_free_rows`` laid out in ``floats`` [6, N] and ``longs`` [3, N], for a
        computation that serves any rows of its kind (a CUDA graph): min-p, and with ``truncates`` top-k
        and top-p, are applied to every row (a filter a row does not use leaves its distribution as it
        was, bit for bit)."""
        return cls(temperature=floats[0], top_p=floats[1], min_p=floats[2], repetition_penalty=floats[3],
                   presence_penalty=floats[4], frequency_penalty=floats[5], seeds=longs[0], counters=longs[1],
                   top_k=longs[2], prompt_tokens=None, output_tokens=None, max_logprobs=None, all_greedy=False,
                   uses_top_k=truncates, uses_top_p=truncates, uses_min_p=True)


class StaticSamplingRows:
    """Device buffers a CUDA graph of up to ``capacity`` penalty-free rows reads its rows' sampling
    parameters from: a graph of ``slots`` rows reads the first 6 * slots floats and 3 * slots longs, laid
    out by ``SamplingTensors.penalty_free_rows``, through ``tensors``; ``write`` puts a step's rows there."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.floats = torch.zeros(6 * capacity, dtype=torch.float32, device=device)
        self.longs = torch.zeros(3 * capacity, dtype=torch.int64, device=device)

    def tensors(self, slots: int, truncates: bool) -> SamplingTensors:
        return SamplingTensors.in_buffers(self.floats[:6 * slots].view(6, slots),
                                          self.longs[:3 * slots].view(3, slots), truncates)

    def write(self, rows: Sequence[tuple[SamplingParams, int, int]], slots: int) -> None:
        """``rows`` ((params, seed, counter) each) for a graph of ``slots`` rows, the rest greedy; two
        copies that do not wait for the device."""
        if not len(rows) <= slots <= self.capacity:
            raise ValueError(f"{len(rows)} rows in {slots} slots: the buffers hold {self.capacity}")
        floats, longs = SamplingTensors.penalty_free_rows(rows, slots)
        self.floats[:len(floats)].copy_(host_tensor(floats, torch.float32), non_blocking=True)
        self.longs[:len(longs)].copy_(host_tensor(longs, torch.int64), non_blocking=True)


def needs_token_history(params: Sequence[SamplingParams]) -> bool:
    """Whether any row's penalties read its prompt / output tokens; ``SamplingTensors.build`` only
    touches those lists then, so callers can skip copying them on the per-step path."""
    return any(p.uses_penalties for p in params)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """Sampled tokens and, when requested, logprobs under the raw model distribution."""

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float32, logprob of token_ids
    top_ids: torch.Tensor | None  # [N, min(max_logprobs, V)] int64
    top_logprobs: torch.Tensor | None  # [N, min(max_logprobs, V)] float32


class Sampler:
    """Samples one token per logits row; no host synchronization, no data-dependent branches."""

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        raw = logits.float()  # [N, V]
        penalized = apply_penalties(raw, t)  # [N, V]
        token_ids = argmax_rows(penalized)  # [N] greedy choice
        if not t.all_greedy:
            sampled = sample_from_probs(_filtered_probs(penalized, t), t.seeds, t.counters)  # [N]
            token_ids = torch.where(t.temperature == 0, token_ids, sampled)
        if t.max_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        logprobs = torch.log_softmax(raw, dim=-1)  # [N, V]
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [N]
        top_logprobs, top_ids = logprobs.topk(min(t.max_logprobs, logprobs.shape[1]), dim=-1)
        return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM semantics); returns new float32 logits.

    Repetition divides positive and multiplies negative logits of every token seen in the prompt
    or the output; frequency subtracts ``frequency_penalty * count`` and presence subtracts
    ``presence_penalty`` once for every token seen in the output.
    """
    logits = logits.float()  # [N, V]
    if t.output_tokens is None:
        return logits
    vocab = logits.shape[1]
    output_counts = _token_counts(t.output_tokens, vocab)  # [N, V]
    if t.prompt_tokens is not None:
        seen = (_token_counts(t.prompt_tokens, vocab) + output_counts) > 0  # [N, V]
        penalty = t.repetition_penalty[:, None]  # [N, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    return (logits - t.frequency_penalty[:, None] * output_counts
            - t.presence_penalty[:, None] * (output_counts > 0))


def processed_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from, [N, V] float32.

    Penalties, temperature, top-k, top-p and min-p, renormalized; greedy rows are a one-hot at the
    argmax of their penalized logits.
    """
    penalized = apply_penalties(logits, t)  # [N, V]
    probs = _filtered_probs(penalized, t)  # [N, V]
    one_hot = torch.zeros_like(probs).scatter_(1, argmax_rows(penalized)[:, None], 1.0)
    return torch.where((t.temperature == 0)[:, None], one_hot, probs)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                      salt: int = SAMPLE_SALT) -> torch.Tensor:
    """One seeded draw per row by the exponential race: ``argmax(p / E)``, ``E = -log(u)``.

    probs: [N, V] (need not be normalized); returns [N] int64. Zero-probability tokens never win.
    On CUDA one kernel hashes and races in registers (backends/sampling_triton.py), the same draw bit for bit.
    """
    if probs.is_cuda:
        from encore.backends.sampling_triton import exponential_race  # triton is imported on first use

        return exponential_race(probs.contiguous(), seeds, counters, salt)
    u = seeded_uniform(seeds, counters, probs.shape[1], salt)  # [N, V]
    return argmax_rows(probs.float() / -torch.log(u))


def seeded_uniform(seeds: torch.Tensor, counters: torch.Tensor, n: int, salt: int = 0) -> torch.Tensor:
    """[N, n] float32 uniforms in (0, 1); entry (i, j) is a hash of (seeds[i], counters[i], j, salt).

    Two 32-bit row keys are absorbed from the 64-bit seed, the 64-bit counter and the salt by
    chains of two different 32-bit finalizers; column j then gets
    ``murmur3(lowbias32(j ^ key1) ^ key2)``, a keyed two-round hash. All values stay below 2**32
    in int64 and products are split so none exceeds 2**63: no reliance on overflow wrapping.
    The top 23 bits give ``(2k + 1) / 2**24``, exact in float32 and strictly inside (0, 1).
    On CUDA one kernel computes it (backends/sampling_triton.py), the same values bit for bit.
    """
    if seeds.is_cuda:
        from encore.backends.sampling_triton import seeded_uniforms  # triton is imported on first use

        return seeded_uniforms(seeds, counters, n, salt)
    words = [seeds & _MASK32, (seeds >> 32) & _MASK32,
             counters & _MASK32, (counters >> 32) & _MASK32, salt & _MASK32]
    key1, key2 = (seeds.new_full(seeds.shape, 0x243F6A88), seeds.new_full(seeds.shape, 0x13198A2E))
    for word in words:
        key1 = _mix32(key1 ^ word, _MURMUR3)  # [N]
        key2 = _mix32(key2 ^ word, _LOWBIAS32)  # [N]
    columns = torch.arange(n, dtype=torch.int64, device=seeds.device)  # [n]
    h = _mix32(_mix32(columns[None, :] ^ key1[:, None], _LOWBIAS32) ^ key2[:, None], _MURMUR3)  # [N, n]
    return ((h >> 9) * 2 + 1).float() * 2.0**-24


def _filtered_probs(penalized: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on penalized logits; [N, V] float32, renormalized.

    Greedy rows are scaled by temperature 1 here (their result is replaced by the caller). Without a
    row that truncates, the top-k / top-p block would keep every token: it is skipped (on CUDA its
    threshold search, elsewhere a sort of the vocabulary); likewise min-p's ops.
    """
    temperature = torch.where(t.temperature > 0, t.temperature, 1.0)  # [N]
    x = penalized / temperature[:, None]  # [N, V]
    if t.truncates and x.is_cuda:
        from encore.backends.truncation_triton import truncation_thresholds  # triton is imported on first use

        tau = truncation_thresholds(x, t.top_k, t.top_p, t.uses_top_k, t.uses_top_p)  # [N]
        x = x.masked_fill(x < tau[:, None], float("-inf"))
    elif t.truncates:
        x = truncated_by_sort(x, t.top_k, t.top_p)
    probs = _softmax(x)  # [N, V]
    if t.uses_min_p:
        probs = probs * (probs >= t.min_p[:, None] * probs.amax(dim=-1, keepdim=True))
    return probs / probs.sum(dim=-1, keepdim=True)


def truncated_by_sort(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p on the renormalized top-k distribution: ``x`` [N, V] with every token a row
    drops set to -inf, through a sort of each row (on CUDA ``backends/truncation_triton.py`` finds each
    row's threshold without one)."""
    vocab = x.shape[1]
    sorted_x = x.sort(dim=-1, descending=True).values  # [N, V]

    k = top_k  # [N]
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    kth = sorted_x.gather(1, (k - 1)[:, None])  # [N, 1]
    in_top_k = sorted_x >= kth  # [N, V] ties with the k-th logit are kept

    sorted_probs = _softmax(sorted_x.masked_fill(~in_top_k, float("-inf")))  # [N, V]
    mass_before = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [N, V] exclusive, monotone
    top_p = top_p[:, None]  # [N, 1]
    # [N, V] a prefix, never empty: the top token is kept even where top_p rounds to 0 in float32
    # (a top_p below 1.4e-45), as the CUDA threshold search keeps it
    in_top_p = in_top_k & ((mass_before < top_p) | (top_p >= 1.0) | (mass_before == 0))
    last = sorted_x.gather(1, in_top_p.sum(dim=-1, keepdim=True) - 1)  # [N, 1]
    return x.masked_fill(x < last, float("-inf"))  # ties with the last kept logit are kept


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over each row of x [N, V] float32; on CUDA in chunks of the row (backends/sampling_triton.py)."""
    if x.is_cuda:
        from encore.backends.sampling_triton import softmax_rows  # triton is imported on first use

        return softmax_rows(x)
    return torch.softmax(x, dim=-1)


def _token_counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, L] ids padded with -1 -> [N, V] float32 occurrence counts (scatter_add, no bincount)."""
    index = torch.where(tokens < 0, vocab, tokens)  # [N, L] padding goes to a spare column
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def _mix32(h: torch.Tensor, consts: tuple[int, int, int, int, int]) -> torch.Tensor:
    """A 32-bit xorshift-multiply finalizer on int64 values in [0, 2**32)."""
    s1, m1, s2, m2, s3 = consts
    h = h ^ (h >> s1)
    h = _mul32(h, m1)
    h = h ^ (h >> s2)
    h = _mul32(h, m2)
    return h ^ (h >> s3)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for x in [0, 2**32) with every int64 intermediate below 2**49."""
    low = x * (c & 0xFFFF)  # < 2**48
    high = ((x * (c >> 16)) & 0xFFFF) << 16  # < 2**32
    return (low + high) & _MASK32


def _padded(rows: Sequence[Sequence[int]]) -> tuple[array.array, int]:
    """Ragged token lists -> their [N, L] int64 host array, row-major and padded with -1, and L. Each
    row is packed into it as an ``array`` (backends/host_tensors.py says why): a step with a repetition
    penalty sends every row's prompt and output, and ``SamplingTensors.build`` for 64 rows of 1k-token
    prompts and 200 outputs took 6.6 ms through ``torch.tensor`` of the padded lists on this repo's
    CPU, 2.0 ms so. A list given for several rows (a verify row's prompt, once for each of its 1 + k
    logits rows) is packed once."""
    width = max((len(row) for row in rows), default=0)
    padded = array.array("q", [-1]) * (len(rows) * width)
    packed: dict[int, array.array] = {}  # id of a row's list -> its array (rows holds the lists: no id is reused)
    for i, row in enumerate(rows):
        if id(row) not in packed:
            packed[id(row)] = array.array("q", row)
        padded[i * width:i * width + len(row)] = packed[id(row)]
    return padded, width
