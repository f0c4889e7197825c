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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from encore.backends.metadata import ForwardMode
from encore.engine.request import Request
from encore.engine.spec.acceptance import verify_greedy
from encore.graphs.keys import GraphKey
from encore.graphs.runner import GraphRunner, capture, reserved_after_sync, warm_up_on_side_stream

log = logging.getLogger(__name__)


def plain_greedy(rows: Sequence[Request]) -> bool:
    """Whether every logits row is its target's argmax and nothing else is read from the logits: all
    greedy, no penalties, no logprobs, no grammar, none short of its ``min_tokens`` (whose stop
    tokens are masked)."""
    return all(r.params.greedy and not r.params.uses_penalties and r.params.logprobs is None and r.grammar is None
               and not r.num_banned_positions for r in rows)


class HeadGraphs:
    def __init__(self, graphs: GraphRunner, greedy_tokens: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``greedy_tokens``: hidden states [T, *] -> the argmax of their logits [T]."""
        self.graphs = graphs
        self.greedy_tokens = greedy_tokens
        self.keys = tuple(key for key in graphs.keys
                          if key.mode is ForwardMode.DECODE and graphs.output(key) is not None)
        device = graphs.buffers.device
        self.tokens = torch.zeros(max((key.num_tokens for key in self.keys), default=0), dtype=torch.int64,
                                  device=device)
        self.accepted = torch.zeros(max((key.bs for key in self.keys), default=0), dtype=torch.int64, device=device)
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
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

    @torch.inference_mode()
    def capture(self) -> None:
        start, before = time.perf_counter(), reserved_after_sync()
        for key in self.keys:
            static = self.graphs.buffers.fill(key, None)

            def fn(key=key, ids=static.input_ids, hidden=self.graphs.output(key)) -> torch.Tensor:
                return self._head(key, ids, hidden)

            warm_up_on_side_stream(fn)
            self._graphs[key] = capture(fn, self.graphs.pool)[0]
        log.info("greedy head graphs: %d DECODE keys captured in %.2fs, pool +%.1f MiB", len(self._graphs),
                 time.perf_counter() - start, (torch.cuda.memory_reserved() - before) / 2**20)

    def run(self, key: GraphKey | None) -> bool:
        """Replays ``key``'s head (right after its target graph replayed); False if it has none."""
        graph = self._graphs.get(key)
        if graph is None:
            return False
        graph.replay()
        self.replays += 1
        return True
