"""CUDA graphs of a DECODE step's greedy head: one replay after the target's graph picks every token.

A DECODE key's graph outputs the hidden states of all its tokens, and every one of them is a logits
row (a decode row samples each of its 1 + k positions). When every row of the step is plain greedy
(no penalties, logprobs or grammar mask: ``plain_greedy``), the head is a fixed computation over
that output, captured per key into the target graphs' pool:

- the LM head over all the key's tokens and their argmax (the greedy pick after each position);
- for a verify key (q_len 1 + k), the greedy verdict against the drafts the step fed (the key's
  static input ids): the leading run of drafts equal to the target's picks, and the row's tokens.

Eager, this is the LM head, a gather, a cast, the argmax and (verify) four or five small ops, each
a launch and host work between the target's replay and the read-back (~60-200 µs a step on
encore-tiny, H100). Results land in two static buffers, ``tokens`` [T] and ``accepted`` [bs]; a
model drafter's draft graphs read their verdict from the same buffers (engine/spec/draft_graphs.py).

A verify key of up to ``MAX_STOCHASTIC_ROWS`` rows has two stochastic heads for steps whose rows
sample (``plain_rows``, and none opted out of speculation): the processed target distribution of every
token (temperature, top-k, top-p and min-p, each row's from a static buffer that ``run_sampled``
writes) and speculative sampling against the drafts (acceptance.verify). A row's draft distributions
come from the static ``draft_probs`` where its flag in ``stochastic`` is set (a model drafter drew its
drafts), else they are one-hot at its drafts (a deterministic proposal). Eager, that is ~150 launches
of host work a step (encore-tiny, MTP k = 2: most of a 5 ms step, against 0.6 ms greedy). One head
applies min-p alone, the other top-k and top-p too (their threshold search,
backends/truncation_triton.py), for steps where a row truncates; a filter a row does not use leaves
its distribution as it was, bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from encore.backends.host_tensors import upload
from encore.backends.metadata import ForwardMode
from encore.engine.request import Request
from encore.engine.sampler import StaticSamplingRows, processed_probs
from encore.engine.sampling_params import SamplingParams
from encore.engine.spec.acceptance import verify, verify_greedy
from encore.graphs.keys import GraphKey
from encore.graphs.runner import GraphRunner, capture, reserved_after_sync, warm_up_on_side_stream

log = logging.getLogger(__name__)

# The most rows a stochastic head or draft graph serves. A head's distributions take ~6 MB of graph
# pool a logits row at V2-Lite's vocabulary (102400: +420 MiB for verify keys of 1 and 16 rows of 4
# tokens, H200), kept for the engine's life; past this a sampled step's host work is a small part of it.
MAX_STOCHASTIC_ROWS = 64


def plain_greedy(rows: Sequence[Request]) -> bool:
    """Whether every logits row is its target's argmax and nothing else is read from the logits: all
    greedy, no penalties, no logprobs, no grammar, none short of its ``min_tokens`` (whose stop
    tokens are masked)."""
    return all(r.params.greedy for r in rows) and plain_rows(rows)


def plain_rows(rows: Sequence[Request]) -> bool:
    """Whether every logits row's token comes from its processed distribution alone and nothing else is
    read from the logits: no penalties, logprobs or grammar, none short of its ``min_tokens``."""
    return all(not r.params.uses_penalties and r.params.logprobs is None and r.grammar is None
               and not r.num_banned_positions for r in rows)


class HeadGraphs:
    def __init__(self, graphs: GraphRunner, greedy_tokens: Callable[[torch.Tensor], torch.Tensor],
                 logits: Callable[[torch.Tensor], torch.Tensor], vocab_size: int, draft_distributions: bool) -> None:
        """``greedy_tokens``: hidden states [T, *] -> the argmax of their logits [T]; ``logits``: hidden
        states [T, *] -> float32 logits [T, V]; ``draft_distributions``: whether drafts may come with
        distributions (a model drafter's), else every proposal is deterministic."""
        self.graphs = graphs
        self.greedy_tokens = greedy_tokens
        self.logits = logits
        self.keys = tuple(key for key in graphs.keys
                          if key.mode is ForwardMode.DECODE and graphs.output(key) is not None)
        device = graphs.buffers.device
        self.tokens = torch.zeros(max((key.num_tokens for key in self.keys), default=0), dtype=torch.int64,
                                  device=device)
        self.accepted = torch.zeros(max((key.bs for key in self.keys), default=0), dtype=torch.int64, device=device)
        # The stochastic heads' inputs: each logits row's sampling parameters, and per row its draft
        # distributions and their flag.
        self.stochastic_keys = tuple(key for key in self.keys
                                     if key.q_len_per_req > 1 and key.bs <= MAX_STOCHASTIC_ROWS)
        rows = max((key.bs for key in self.stochastic_keys), default=0)
        k = max((key.q_len_per_req - 1 for key in self.stochastic_keys), default=0)
        self.sampling = StaticSamplingRows(max((key.num_tokens for key in self.stochastic_keys), default=0), device)
        self.draft_probs = torch.zeros(rows if draft_distributions else 0, k, vocab_size, dtype=torch.float32,
                                       device=device)
        self.stochastic = torch.zeros(rows, dtype=torch.bool, device=device)
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._sampled: dict[tuple[GraphKey, bool], torch.cuda.CUDAGraph] = {}  # (key, whether it truncates)
        self.replays = 0

    def _head(self, key: GraphKey, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        picks = self.greedy_tokens(hidden)  # [T]
        tokens = self.tokens[:key.num_tokens]
        if key.q_len_per_req == 1:
            return tokens.copy_(picks)
        bs, q = key.bs, key.q_len_per_req
        verdict = verify_greedy(picks.view(bs, q), input_ids.view(bs, q)[:, 1:])
        self.accepted[:bs].copy_(verdict.num_accepted)
        return tokens.copy_(verdict.tokens.flatten())

    def _sampled_head(self, truncates: bool, key: GraphKey, input_ids: torch.Tensor, hidden: torch.Tensor
                      ) -> torch.Tensor:
        T, bs, q = key.num_tokens, key.bs, key.q_len_per_req
        t = self.sampling.tensors(T, truncates)
        probs = processed_probs(self.logits(hidden), t).view(bs, q, -1)  # [bs, q, V]
        drafts = input_ids.view(bs, q)[:, 1:]  # [bs, k]
        draft_probs = torch.zeros_like(probs[:, 1:]).scatter_(2, drafts[..., None], 1.0)  # [bs, k, V] one-hot
        if self.draft_probs.shape[0]:
            draft_probs = torch.where(self.stochastic[:bs, None, None], self.draft_probs[:bs], draft_probs)
        verdict = verify(probs, drafts, draft_probs, t.seeds[::q], t.counters[::q])
        self.accepted[:bs].copy_(verdict.num_accepted)
        return self.tokens[:T].copy_(verdict.tokens.flatten())

    @torch.inference_mode()
    def capture(self) -> None:
        start, before = time.perf_counter(), reserved_after_sync()
        for key in self.keys:
            static = self.graphs.buffers.fill(key, None)
            heads = [(self._head, self._graphs, key)]
            if key in self.stochastic_keys:
                heads += [(partial(self._sampled_head, truncates), self._sampled, (key, truncates))
                          for truncates in (False, True)]
                self.sampling.write([], key.num_tokens)  # greedy rows: warm-up and capture read valid values
            for head, graphs, at in heads:
                def fn(head=head, key=key, ids=static.input_ids, hidden=self.graphs.output(key)) -> torch.Tensor:
                    return head(key, ids, hidden)

                warm_up_on_side_stream(fn)
                graphs[at] = capture(fn, self.graphs.pool)[0]
        log.info("head graphs: %d DECODE keys (%d with stochastic verify heads) captured in %.2fs, "
                 "pool +%.1f MiB", len(self._graphs), len(self._sampled) // 2, time.perf_counter() - start,
                 (torch.cuda.memory_reserved() - before) / 2**20)

    def run(self, key: GraphKey | None) -> bool:
        """Replays ``key``'s head (right after its target graph replayed); False if it has none."""
        graph = self._graphs.get(key)
        if graph is None:
            return False
        graph.replay()
        self.replays += 1
        return True

    def run_sampled(self, key: GraphKey | None, rows: list[tuple[SamplingParams, int, int]],
                    draft_probs: list[torch.Tensor | None]) -> bool:
        """Replays ``key``'s stochastic verify head (right after its target graph replayed); False if it
        has none. ``rows``: (params, seed, counter) of each logits row, a verify row's 1 + k in order;
        ``draft_probs``: each verify row's draft distributions [k, V], or None where it drafted
        deterministically."""
        graph = self._sampled.get((key, any(params.truncates for params, _, _ in rows)))
        if graph is None:
            return False
        self.sampling.write(rows, key.num_tokens)
        flags = [int(q is not None) for q in draft_probs]
        stochastic = [q for q in draft_probs if q is not None]
        at = [i for i, flag in enumerate(flags) if flag]
        flags_d, at_d = upload([(flags, torch.int64), (at, torch.int64)], self.stochastic.device)
        self.stochastic[:len(flags)].copy_(flags_d)
        if at and len(at) == len(flags):
            torch.stack(stochastic, out=self.draft_probs[:len(flags)])
        elif at:
            self.draft_probs.index_copy_(0, at_d, torch.stack(stochastic))
        graph.replay()
        self.replays += 1
        return True
