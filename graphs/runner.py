"""Runs steps on graph keys: the compiled callable of each key's family and, on CUDA, its captured graph.

``prepare`` runs every key (and captures it) once, largest first: CUDA graphs share one memory
pool, and a pool sized by the largest capture is reused by every smaller one. A family's graph is
compiled on its first key, its largest (graphs/compiler.py), and every later key of the family
only runs it at its own sizes. Each capture runs on
the static step buffers with an all-padding step bound in the step context, after a warm-up that
compiles, autotunes and JIT-builds whatever the step touches. ``run`` pads a step to its key's
buffers, plans the backend's metadata outside the graph, then calls its family's compiled callable
or replays the key's graph. A step that fits no key runs unpadded on its family's compiled graph,
which serves any size (graphs/compiler.py): Inductor's kernels without a captured graph, 1.5-3x
faster than the eager model on the DeepSeek-V2-Lite shape (benchmarks/README.md). Only a step
whose family has no key, or any step when compiling is off, returns None: the caller runs it eager.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from encore.backends.base import AttentionBackend
from encore.backends.context import StepContext
from encore.backends.metadata import ForwardBatch, ForwardMode
from encore.graphs.compiler import CompiledModel
from encore.graphs.keys import GraphKey, KeyTable
from encore.graphs.padding import StepBuffers

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KeyReport:
    """What preparing one key took: compile (first call, warm-up included) and capture seconds, the
    graph pool's growth in bytes during the capture (0 without CUDA graphs), and how many graphs its
    first call compiled or loaded precompiled (one or the other on a family's first key, neither on
    the rest, whose compile_s is a plain run)."""

    key: GraphKey
    compile_s: float
    capture_s: float
    pool_bytes: int
    graphs_compiled: int = 0
    graphs_loaded: int = 0

    @property
    def built(self) -> bool:
        """Whether this key's first call built its family's graph (compiled or loaded it)."""
        return bool(self.graphs_compiled or self.graphs_loaded)

    @property
    def first_call(self) -> str:
        """What this key's first call did: compiled its family's graph, loaded it precompiled, or only ran it."""
        return "compile" if self.graphs_compiled else "load" if self.graphs_loaded else "run"


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [T, hidden], the graph's output, overwritten by every replay in the pool


class GraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, context: StepContext,
                 keys: tuple[GraphKey, ...], buffers: StepBuffers, compiled: CompiledModel | None,
                 cuda_graphs: bool) -> None:
        """``compiled`` None runs (and captures) the eager model on each key."""
        if not keys:
            raise ValueError("GraphRunner needs at least one graph key; none fit the step budget")
        self.model = model
        self.backend = backend
        self.context = context
        self.table = KeyTable(keys)
        self.families = frozenset(k.mode for k in keys)
        self.keys = tuple(sorted(keys, key=lambda k: (k.num_tokens, k.bs), reverse=True))  # largest first
        self.buffers = buffers
        self.compiled = compiled
        self.cuda_graphs = cuda_graphs
        self.pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self._captured: dict[GraphKey, _Captured] = {}
        self.graph_replays = 0
        self.compiled_steps = 0
        self.steps_per_key: Counter[GraphKey] = Counter()
        # The key whose graph the last ``run`` replayed (None: it ran compiled, or no key held it);
        # a drafter's graph for that key reads the replay's output and step buffers (engine/spec).
        self.last_replayed: GraphKey | None = None

    def _call(self, key: GraphKey, batch: ForwardBatch) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled(key, batch)
        return self.model(batch.input_ids, batch.positions, batch)

    @torch.inference_mode()
    def prepare(self, on_key: Callable[[int, KeyReport], None] | None = None) -> list[KeyReport]:
        """Compiles (and captures) every key, largest first; ``on_key(index, report)`` after each."""
        reports = []
        warmed: set[ForwardMode] = set()  # families whose first key ran its warm-up
        for index, key in enumerate(self.keys):
            static = self.buffers.fill(key, None)
            with self.context.bind(static):
                self.backend.plan(static, static=True)
                start, before = time.perf_counter(), self._graph_counts()
                if self.cuda_graphs:
                    warm_up_on_side_stream(lambda: self._call(key, static), runs=1 if key.mode in warmed else 2)
                    warmed.add(key.mode)
                else:
                    self._call(key, static)
                compile_s, after = time.perf_counter() - start, self._graph_counts()
                capture_s, pool_bytes = self._capture(key, static) if self.cuda_graphs else (0.0, 0)
            report = KeyReport(key, compile_s, capture_s, pool_bytes, after[0] - before[0], after[1] - before[1])
            log.info("graph key %d/%d %s: %s %.1fs, capture %.2fs, pool +%.1f MiB", index + 1, len(self.keys), key,
                     report.first_call, compile_s, capture_s, pool_bytes / 2**20)
            reports.append(report)
            if on_key is not None:
                on_key(index, report)
        return reports

    def _graph_counts(self) -> tuple[int, int]:
        """(graphs compiled, graphs loaded precompiled) so far."""
        if self.compiled is None:
            return 0, 0
        return self.compiled.compiled_graphs, self.compiled.loaded_graphs

    def _capture(self, key: GraphKey, static: ForwardBatch) -> tuple[float, int]:
        start, before = time.perf_counter(), reserved_after_sync()
        graph, hidden = capture(lambda: self._call(key, static), self.pool)
        self._captured[key] = _Captured(graph, hidden)
        return time.perf_counter() - start, torch.cuda.memory_reserved() - before

    def output(self, key: GraphKey) -> torch.Tensor | None:
        """``key``'s captured output buffer (its hidden states, rewritten by each replay), or None."""
        captured = self._captured.get(key)
        return captured.hidden if captured is not None else None

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, GraphKey] | None:
        """Hidden states [key.num_tokens, hidden] of ``batch`` padded to its key, or None if no key holds
        it. Map the batch's token indices into them with ``padding.padded_index``."""
        self.last_replayed = None
        key = self.table.find(batch)
        if key is None or batch.page_table.shape[1] > self.buffers.max_pages:
            return self._run_unpadded(batch)
        padded = self.buffers.fill(key, batch)
        self.steps_per_key[key] += 1
        captured = self._captured.get(key)
        with self.context.bind(padded):
            self.backend.plan(padded, static=True)
            if captured is not None:
                captured.graph.replay()
                self.graph_replays += 1
                self.last_replayed = key
                return captured.hidden, key
            hidden = self._call(key, padded)
        self.compiled_steps += 1
        return hidden, key

    def _run_unpadded(self, batch: ForwardBatch) -> tuple[torch.Tensor, GraphKey] | None:
        """A step that no key holds, run at its own sizes on its family's compiled graph (which that
        family's keys built while preparing): the key returned is the step's own shape. None where
        there is no such graph, or its guards reject the step (nothing compiles while serving): the
        caller runs the step eager."""
        if self.compiled is None or batch.mode not in self.families:
            return None
        key = GraphKey(batch.num_extends, batch.q_len_per_req, batch.bs, batch.num_tokens)
        batch.resolve_pending()
        with self.context.bind(batch):
            self.backend.plan(batch)
            hidden = self.compiled.run_unkeyed(key, batch)
        if hidden is None:
            return None
        self.compiled_steps += 1
        return hidden, key


def warm_up_on_side_stream(fn: Callable[[], object], runs: int = 2) -> None:
    """Runs ``fn`` ``runs`` times outside the capture stream (the CUDA-graph docs' recipe): lazy
    initializations, autotuning and allocator growth must not happen during capture. ``GraphRunner``
    runs a family's first key twice and each later key once: the family's kernels, libraries and
    workspaces are set up by then (H200, 39 default keys of the V2-Lite shape, warm starts in turns:
    ready in 12.4 / 12.9 s with two runs a key, 10.9 / 11.7 s with this)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(runs):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def reserved_after_sync() -> int:
    """Reserved bytes with the allocator's cache emptied: torch.cuda.graph() empties it on entry, so
    the reserved memory after a capture minus this is the capture's pool growth alone."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def capture(fn: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Captures ``fn`` into a new graph in ``pool``; returns it and ``fn``'s output (a static buffer)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    torch.cuda.synchronize()
    return graph, out
