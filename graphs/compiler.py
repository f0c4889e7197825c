"""The encore compile backend and the per-key compiled model.

``torch.compile(entry, backend=EncoreBackend(key, ...), fullgraph=True, dynamic=False)`` per graph
key. Dynamo hands the backend a torch-level FX graph; the backend re-traces it to ATen with
``make_fx`` (in dynamo's fake mode: every tensor carries ``meta["val"]``, encore's custom ops appear
as themselves, mutation as mutation), runs encore's passes on that graph, and gives the result to
Inductor. Passes therefore see one graph per key and may specialize on it (a DECODE key's graph
loses its prefill branch); Inductor's FX-graph cache keys on the graph after the passes, so what the
passes did is part of every cache key without a ``CustomGraphPass.uuid``.

Why a fresh code object per key: dynamo keeps its compiled entries, and its recompile limit, per
code object, so keys sharing one entry function would evict each other past the limit; with one each,
a key compiles once and any later recompile (a guard that failed) is counted per key. Recompiles are
bounded: past ``max_compiles`` a key's backend stops compiling and hands dynamo's graph back to run
as it is (eager speed, still correct), so a guard that keeps failing cannot keep the GPU waiting on
the compiler.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from encore.graphs.keys import GraphKey

log = logging.getLogger(__name__)


class GraphPass(Protocol):
    """What passes/ provides: rewrite the graph in place, and say how many times it matched."""

    matches: int

    def __call__(self, graph: fx.Graph) -> None: ...


@dataclass(slots=True)
class CompileRecord:
    """What compiling one key cost. ``compiles`` > 1 means dynamo recompiled it (a guard failed)."""

    compiles: int = 0
    seconds: float = 0.0
    matches: dict[str, int] = field(default_factory=dict)


class EncoreBackend:
    """A dynamo backend for one key: ATen re-trace, encore's passes, then Inductor (or, with
    ``inductor=False``, the rewritten graph run as is — what pass tests use)."""

    def __init__(self, key: GraphKey, passes: Sequence[GraphPass], record: CompileRecord, inductor: bool = True,
                 compile_threads: int | None = None, max_compiles: int = 2) -> None:
        self.key = key
        self.passes = tuple(passes)
        self.record = record
        self.inductor = inductor
        self.compile_threads = compile_threads
        self.max_compiles = max_compiles

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        start = time.perf_counter()
        self.record.compiles += 1
        if self.record.compiles > 1:
            log.warning("graph key %s is being recompiled (compile #%d): a dynamo guard failed",
                        self.key, self.record.compiles)
        if self.record.compiles > self.max_compiles:
            log.warning("graph key %s: past %d compiles, running dynamo's graph uncompiled", self.key,
                        self.max_compiles)
            return gm
        graph_module = aten_graph(gm, example_inputs)
        for graph_pass in self.passes:
            graph_pass(graph_module.graph)
            self.record.matches[type(graph_pass).__name__] = graph_pass.matches
        graph_module.graph.lint()
        graph_module.recompile()
        if self.inductor:
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            patches = {} if self.compile_threads is None else {"compile_threads": self.compile_threads}
            with inductor_config.patch(patches):
                compiled = compile_fx(graph_module, example_inputs)
        else:
            compiled = graph_module
        self.record.seconds += time.perf_counter() - start
        return compiled


def aten_graph(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
    """Re-traces dynamo's graph to ATen in dynamo's own fake mode (so views of one parameter storage
    stay views of one fake storage, which the pre-attention fusion relies on)."""
    fake_mode = detect_fake_mode(example_inputs)
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fake_mode:
        return make_fx(gm, tracing_mode="real")(*fakes)


def _entry(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
    return model(input_ids, positions, batch)


def fresh_entry() -> Callable:
    """A copy of ``_entry`` with its own code object, hence its own dynamo cache (module docstring)."""
    return types.FunctionType(_entry.__code__.replace(), _entry.__globals__, "encore_step")


class CompiledModel:
    """One compiled callable per graph key, compiled on first use.

    ``passes_for(key)`` builds the key's pass list (passes are specialized by key)."""

    def __init__(self, model: torch.nn.Module, passes_for: Callable[[GraphKey], Sequence[GraphPass]],
                 inductor: bool = True, compile_threads: int | None = None) -> None:
        self.model = model
        self.passes_for = passes_for
        self.inductor = inductor
        self.compile_threads = compile_threads
        self.records: dict[GraphKey, CompileRecord] = {}
        self._compiled: dict[GraphKey, Callable] = {}

    def __call__(self, key: GraphKey, batch) -> torch.Tensor:
        """Runs ``batch`` (already padded to ``key``, bound in the step context) -> hidden [T, hidden]."""
        fn = self._compiled.get(key)
        if fn is None:
            record = self.records[key] = CompileRecord()
            backend = EncoreBackend(key, self.passes_for(key), record, self.inductor, self.compile_threads)
            fn = self._compiled[key] = torch.compile(fresh_entry(), backend=backend, fullgraph=True, dynamic=False)
        return fn(self.model, batch.input_ids, batch.positions, batch)

    @property
    def compiled_keys(self) -> int:
        return len(self.records)

    @property
    def recompiles(self) -> int:
        return sum(max(r.compiles - 1, 0) for r in self.records.values())
