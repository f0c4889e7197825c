"""CUDA graphs of a model drafter's greedy draft: one replay drafts k tokens for a step.

DESIGN.md step 8 runs the drafter right after verification: a first pass over the step's own
layout, then k - 1 decode steps of q_len 1. For a step that replayed the target's graph on key K,
all of it is one CUDA graph per K, captured after the target's graphs, into their pool. The first
pass reads K's static step buffers (still holding this step, and the backend's plan for it, made
before the target's replay) and K's graph output (the target's hidden states); draft steps 2..k are
decode-only q_len-1 steps of the drafting rows whose positions, lengths and cache slots are computed
inside the graph (their pages already hold the k - 1 lookahead slots), so each has its own metadata,
planned on the device. A backend that needs host lengths to plan (flashinfer) runs them on its
device-planned kernels: counted in its fallback steps per replay.

- A DECODE verify key (bs rows of 1 + k tokens): the first pass is fed the verdict's tokens — every
  1 + k position of each row, rejected ones included (padded speculation) — from a static buffer that
  the key's greedy head graph (engine/head_graphs.py) writes, or ``run`` copies an eager verdict
  into; each row's first draft is read at its own accepted position (a static buffer of accepted
  counts, written the same way).
- A key with prefill rows (EXTEND, or MIXED with verify rows of 1 + k tokens): the first pass is fed
  the prefill tokens shifted by one (the host's, and the step's sampled token where a row completes
  its prompt), then the verify rows' verdict tokens; the drafting rows — prefill rows that complete
  their prompt, then the verify rows — sit in ``bs`` slots, each naming its first-pass token and its
  row (a verify row's token moved by its accepted count on the device). Slots past the drafting rows
  draft from position 0 on the dummy page alone. ``run_prefill`` uploads these in one host-to-device copy. Its
  first pass is the drafter's eager module even when the drafter is compiled (the compiled drafter is
  specialized to decode-only steps); inside the graph that costs no host work.

A step with a sampling row drafts stochastically: each draft is drawn from the drafter's processed
distribution (the row's temperature, top-k, top-p and min-p; no penalties), which verification needs
too. A key of up to ``MAX_STOCHASTIC_ROWS`` slots (head_graphs.py says why) has two more graphs for
that, whose slots read their sampling parameters from a static buffer (``run`` and ``run_prefill``
write it, a slot past the drafting rows greedy) and which write the k distributions of every slot into
``probs`` [bs, k, V] beside the drafts: one applies min-p alone, the other top-k and top-p too (their
threshold search), for steps where a row truncates (a filter a slot does not use keeps its
distribution bit for bit). A step that ran on no such key drafts eager; the speculator counts those in
``drafter_eager_steps``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from encore.backends.host_tensors import host_tensor
from encore.backends.metadata import ForwardBatch, ForwardMode
from encore.engine.kv_cache import DUMMY_PAGE
from encore.engine.head_graphs import MAX_STOCHASTIC_ROWS
from encore.engine.sampler import SamplingTensors, StaticSamplingRows
from encore.engine.sampling_params import SamplingParams
from encore.engine.spec.acceptance import Verdict
from encore.graphs.keys import GraphKey
from encore.graphs.runner import GraphRunner, capture, reserved_after_sync, warm_up_on_side_stream

log = logging.getLogger(__name__)

# draft(static step, first-pass input ids [T], target hidden [T, *], first-pass token of each drafting
# slot [bs], that token's position [bs], page table of each slot [bs, P], the slots' sampling parameters
# or None for greedy drafts) -> (drafts [bs, k], their distributions [bs, k, V] or None when greedy). The
# sampling parameters' counters hold each slot's prompt length: a draft at position p is its request's
# output token p + 2 - prompt length.
DraftFn = Callable[[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                    SamplingTensors | None], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(slots=True)
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    drafts: torch.Tensor  # [bs, k], the graph's output, rewritten by each replay
    fallback_steps: int  # attention steps per replay the backend ran on its fallback kernels


class DraftGraphs:
    def __init__(self, graphs: GraphRunner, k: int, vocab_size: int, draft: DraftFn, tokens: torch.Tensor,
                 accepted: torch.Tensor) -> None:
        """``tokens`` [≥ T] and ``accepted`` [≥ bs]: the static buffers the verify keys' graphs read a
        step's verdict from, which a key's greedy head graph writes (engine/head_graphs.py)."""
        self.graphs = graphs
        self.context = graphs.context
        self.backend = graphs.backend
        self.draft = draft
        self.q_len = 1 + k
        captured = [key for key in graphs.keys if graphs.output(key) is not None]  # largest first
        self.keys = tuple(key for key in captured if key.mode is ForwardMode.DECODE and key.q_len_per_req == self.q_len)
        self.prefill_keys = tuple(key for key in captured if key.num_extends
                                  and (not key.num_decodes or key.q_len_per_req == self.q_len))
        self.input_ids = tokens
        self.accepted = accepted
        # A prefill key's inputs: first-pass ids [T], then per slot its first-pass token, its row, the
        # verify row whose accepted count moves that token (-1: none) and that count; the drafting rows'
        # count; the tokens where a prefill row completes its prompt (up to bs).
        self.prefill_inputs = torch.zeros(max((key.num_tokens + 5 * key.bs + 1 for key in self.prefill_keys),
                                              default=0), dtype=torch.int64, device=tokens.device)
        # The stochastic graphs' inputs (each slot's sampling parameters, its prompt length for counter) and
        # their output distributions.
        slots = max((key.bs for key in self.keys + self.prefill_keys if key.bs <= MAX_STOCHASTIC_ROWS), default=0)
        self.sampling = StaticSamplingRows(slots, tokens.device)
        self.probs = torch.zeros(slots, k, vocab_size, dtype=torch.float32, device=tokens.device)
        self._graphs: dict[GraphKey, _DraftGraph] = {}
        self._sampled: dict[tuple[GraphKey, bool], _DraftGraph] = {}  # (key, whether it truncates)
        self.replays = 0

    def _verify_draft(self, key: GraphKey, static: ForwardBatch, sampling: SamplingTensors | None):
        ids, hidden = self.input_ids[:key.num_tokens], self.graphs.output(key)
        src = torch.arange(key.bs, device=ids.device) * self.q_len + self.accepted[:key.bs]  # [bs]
        return self.draft(static, ids, hidden, src, static.positions[src], static.page_table, sampling)

    def _prefill_draft(self, key: GraphKey, static: ForwardBatch, sampling: SamplingTensors | None):
        ids, base, rows, verify_row, accepted, count = self._prefill_views(key)
        moved = torch.where(verify_row >= 0, accepted[verify_row.clamp(min=0)], 0)  # [bs]
        src = base + moved  # [bs]
        drafting = torch.arange(key.bs, device=ids.device) < count  # [bs]
        # A spare slot drafts on the dummy page from position 0: its decode passes read one page.
        positions = torch.where(drafting, static.positions[src], 0)  # [bs]
        table = torch.where(drafting[:, None], static.page_table[rows], DUMMY_PAGE)  # [bs, P]
        return self.draft(static, ids, self.graphs.output(key), src, positions, table, sampling)

    def _prefill_views(self, key: GraphKey) -> tuple[torch.Tensor, ...]:
        T, bs = key.num_tokens, key.bs
        ids, slots = self.prefill_inputs[:T], self.prefill_inputs[T:T + 4 * bs + 1]
        return ids, slots[:bs], slots[bs:2 * bs], slots[2 * bs:3 * bs], slots[3 * bs:4 * bs], slots[4 * bs:]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every verify key's greedy and stochastic drafts, then every prefill key's. Warm-up
        and capture run the drafter on all-padding steps; the backend's fallback count is left as it was
        (those are not serving steps)."""
        start = time.perf_counter()
        before = reserved_after_sync()
        for key, build in [(key, self._verify_draft) for key in self.keys] + [
                (key, self._prefill_draft) for key in self.prefill_keys]:
            static = self.graphs.buffers.fill(key, None)

            def greedy(key=key, static=static, build=build) -> torch.Tensor:
                return build(key, static, None)[0]

            def sampled(truncates: bool, key=key, static=static, build=build) -> torch.Tensor:
                drafts, probs = build(key, static, self.sampling.tensors(key.bs, truncates))
                self.probs[:key.bs].copy_(probs)
                return drafts

            with self.context.bind(static):
                self.backend.plan(static, static=True)  # what the target's replay leaves for the first pass
            variants = [(greedy, self._graphs, key)]
            if key.bs <= MAX_STOCHASTIC_ROWS:
                variants += [(partial(sampled, truncates), self._sampled, (key, truncates))
                             for truncates in (False, True)]
                self.sampling.write([], key.bs)  # greedy slots: warm-up and capture read valid parameters
            for fn, graphs, at in variants:
                fallbacks = self.backend.fallback_steps
                warm_up_on_side_stream(fn)
                warmed = self.backend.fallback_steps
                graph, drafts = capture(fn, self.graphs.pool)
                graphs[at] = _DraftGraph(graph, drafts, self.backend.fallback_steps - warmed)
                self.backend.fallback_steps = fallbacks
        log.info("drafter graphs (greedy and stochastic): %d verify keys and %d prefill keys captured in %.1fs, "
                 "pool +%.1f MiB", len(self.keys), len(self.prefill_keys), time.perf_counter() - start,
                 (torch.cuda.memory_reserved() - before) / 2**20)

    def run(self, key: GraphKey | None, rows: int, verdict: Verdict | None,
            sampling: list[tuple[SamplingParams, int, int]] | None = None) -> torch.Tensor | None:
        """Drafts [rows, k] of a verify step that just replayed the target's graph on ``key``, given its
        verdict (tokens [rows, 1 + k], accepted counts [rows]) or None where the key's head graph has
        just written it to the buffers; None if ``key`` has no draft graph. Greedy, or with ``sampling``
        ((params, seed, prompt length) of each row) stochastic, their distributions then in ``probs``."""
        captured = self._take(key, sampling)
        if captured is None:
            return None
        if verdict is not None:
            # Padded rows keep whatever an earlier step left: valid tokens and counts, read only by
            # their own outputs, which are dropped.
            self.input_ids[:verdict.tokens.numel()].copy_(verdict.tokens.flatten())
            self.accepted[:rows].copy_(verdict.num_accepted)
        return self._replay(captured, rows)

    def run_prefill(self, key: GraphKey | None, shifted: list[int], completing: list[tuple[int, int]],
                    plain_tokens: torch.Tensor, verdict: Verdict,
                    sampling: list[tuple[SamplingParams, int, int]] | None = None) -> torch.Tensor | None:
        """Drafts [D, k] of a step with prefill rows that just replayed the target's graph on ``key``;
        None if ``key`` has no draft graph. ``shifted``: the step's prefill tokens shifted by one (a
        placeholder where a row completes its prompt); ``completing``: (row, token) of each prefill row
        that completes its prompt, whose token is fed that row's sampled token (``plain_tokens`` [c]);
        ``verdict``: the verify rows' (tokens [R, 1 + k], accepted [R]); ``sampling`` as in ``run``.
        The D = c + R drafting rows are the completing rows, then the verify rows."""
        captured = self._take(key, sampling)
        if captured is None:
            return None
        T, bs, P = key.num_tokens, key.bs, key.num_extend_tokens
        rows = verdict.num_accepted.shape[0]
        c = len(completing)
        pad = [0] * (bs - c - rows)
        host = (shifted + [0] * (T - len(shifted))
                + [token for _, token in completing] + [P + j * self.q_len for j in range(rows)] + pad
                + [row for row, _ in completing] + [key.num_extends + j for j in range(rows)] + pad
                + [-1] * c + list(range(rows)) + [-1] * len(pad)
                + [0] * bs + [c + rows] + [token for _, token in completing])
        self.prefill_inputs[:len(host)].copy_(host_tensor(host, torch.int64), non_blocking=True)
        ids, _, _, _, accepted, _ = self._prefill_views(key)
        if rows:
            ids[P:P + rows * self.q_len].copy_(verdict.tokens.flatten())
            accepted[:rows].copy_(verdict.num_accepted)
        if c:
            at = self.prefill_inputs[T + 4 * bs + 1:T + 4 * bs + 1 + c]
            ids.index_copy_(0, at, plain_tokens)
        return self._replay(captured, c + rows)

    def _take(self, key: GraphKey | None, sampling: list[tuple[SamplingParams, int, int]] | None
              ) -> _DraftGraph | None:
        """``key``'s greedy graph, or its stochastic one with the rows' ``sampling`` in its buffers."""
        if sampling is None:
            return self._graphs.get(key)
        captured = self._sampled.get((key, any(params.truncates for params, _, _ in sampling)))
        if captured is not None:
            self.sampling.write(sampling, key.bs)
        return captured

    def _replay(self, captured: _DraftGraph, rows: int) -> torch.Tensor:
        captured.graph.replay()
        self.replays += 1
        self.backend.fallback_steps += captured.fallback_steps
        return captured.drafts[:rows]
