"""CUDA graphs of a model drafter's greedy draft: one replay drafts k tokens for a verify step.

DESIGN.md step 8 runs the drafter right after verification: a first pass over the step's own
layout, then k - 1 decode steps of q_len 1. For a DECODE verify step that replayed the target's
graph on key K (bs rows of 1 + k tokens), all of it is one CUDA graph per K, captured after the
target's graphs, into their pool:

- the first pass reads K's static step buffers (still holding this step, and the backend's plan
  for it, made before the target's replay) and K's graph output (the target's hidden states), fed
  the verdict's tokens — every 1 + k position of each row, rejected ones included (padded
  speculation) — which ``run`` copies into a static buffer;
- each row's first draft is read at its own accepted position (a static buffer of accepted counts);
- draft steps 2..k are decode-only q_len-1 steps of the same rows whose positions, lengths and
  cache slots are computed inside the graph (their pages already hold the k - 1 lookahead slots),
  so each has its own metadata, planned on the device. A backend that needs host lengths to plan
  (flashinfer) runs them on its device-planned kernels: counted in its fallback steps per replay.

Greedy only: a step with a sampling row drafts eager (it needs the draft distributions), as do
MIXED and EXTEND steps; the speculator counts those in ``drafter_eager_steps``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from encore.backends.metadata import ForwardBatch, ForwardMode
from encore.graphs.keys import GraphKey
from encore.graphs.runner import GraphRunner, capture, reserved_after_sync, warm_up_on_side_stream

log = logging.getLogger(__name__)

# draft(static step, input ids [T], target hidden [T, *], accepted [bs]) -> greedy drafts [bs, k]
DraftFn = Callable[[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    drafts: torch.Tensor  # [bs, k], the graph's output, rewritten by each replay
    fallback_steps: int  # attention steps per replay the backend ran on its fallback kernels


class DraftGraphs:
    def __init__(self, graphs: GraphRunner, k: int, draft: DraftFn) -> None:
        self.graphs = graphs
        self.context = graphs.context
        self.backend = graphs.backend
        self.draft = draft
        self.keys = tuple(key for key in graphs.keys  # largest first, like the target's captures
                          if key.mode is ForwardMode.DECODE and key.q_len_per_req == 1 + k
                          and graphs.output(key) is not None)
        device = graphs.buffers.input_ids.device
        self.input_ids = torch.zeros(max((key.num_tokens for key in self.keys), default=0), dtype=torch.int64,
                                     device=device)
        self.accepted = torch.zeros(max((key.bs for key in self.keys), default=0), dtype=torch.int64, device=device)
        self._graphs: dict[GraphKey, _DraftGraph] = {}
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every verify key's draft. Warm-up and capture run the drafter on all-padding
        steps; the backend's fallback count is left as it was (those are not serving steps)."""
        start = time.perf_counter()
        before = reserved_after_sync()
        for key in self.keys:
            static = self.graphs.buffers.fill(key, None)
            ids, accepted = self.input_ids[:key.num_tokens], self.accepted[:key.bs]
            hidden = self.graphs.output(key)

            def fn(static=static, ids=ids, hidden=hidden, accepted=accepted) -> torch.Tensor:
                return self.draft(static, ids, hidden, accepted)

            with self.context.bind(static):
                self.backend.plan(static, static=True)  # what the target's replay leaves for the first pass
            fallbacks = self.backend.fallback_steps
            warm_up_on_side_stream(fn)
            warmed = self.backend.fallback_steps
            graph, drafts = capture(fn, self.graphs.pool)
            self._graphs[key] = _DraftGraph(graph, drafts, self.backend.fallback_steps - warmed)
            self.backend.fallback_steps = fallbacks
        log.info("drafter graphs: %d verify keys captured in %.1fs, pool +%.1f MiB", len(self._graphs),
                 time.perf_counter() - start, (torch.cuda.memory_reserved() - before) / 2**20)

    def run(self, key: GraphKey | None, tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor | None:
        """Greedy drafts [D, k] of a verify step that just replayed the target's graph on ``key``,
        given the verdict's tokens [D, 1 + k] and accepted counts [D]; None if ``key`` has no draft graph."""
        captured = self._graphs.get(key) if key is not None else None
        if captured is None:
            return None
        rows = tokens.shape[0]
        # Padded rows keep whatever an earlier step left: valid tokens and counts, read only by
        # their own outputs, which are dropped.
        self.input_ids[:tokens.numel()].copy_(tokens.flatten())
        self.accepted[:rows].copy_(num_accepted)
        captured.graph.replay()
        self.replays += 1
        self.backend.fallback_steps += captured.fallback_steps
        return captured.drafts[:rows]
