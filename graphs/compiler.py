"""The encore compile backend and the model compiled once per graph family.

A *family* is what encore's passes specialize on: the step's mode (``ForwardMode`` DECODE, MIXED or
EXTEND). Every graph key of one mode shares one ``torch.compile(..., backend=EncoreBackend(mode),
fullgraph=True)`` whose token count and prefill-token count are symbolic, the way vLLM compiles one
dynamic-shape graph and captures CUDA graphs per size: dynamo traces, the passes run and Inductor
compiles once per family, and each further key of the family only runs (and, on CUDA, captures)
the compiled callable at its own sizes. A key's batch size, prefill rows and decode q_len never
reach the graph: the model reads none of them, and the attention ops read them from the step context
(``backends/context.py``), outside the graph — so one family's graph serves them all.

What is symbolic: dim 0 of ``input_ids`` and ``positions`` (T, the step's tokens), marked with
``torch._dynamo.mark_dynamic`` on every call, under ``dynamic=False``: ``dynamic=True`` would also
make the weights, the RoPE table and every other tensor the step touches dynamic, and
automatic dynamic would turn any other shape that changes into a symbol silently. A MIXED step also
passes a view of its first ``num_extend_tokens`` ids (n, marked too): the dispatch-split pass cuts
attention at n, so n must be a graph input, which ``aten_graph`` tags ``meta["step_size"] =
NUM_EXTEND_TOKENS`` for the passes. So is dim 0 of every KV pool (its page count): an engine sizes
its pool from the memory free at start-up, and a precompiled graph must serve a start with a page
more or less. The pools persist from step to step, and a precompiled graph's guards, loaded from its
file, reject a tensor dynamo-marked at run time (the saved guards keep no tensor's marks), so
``symbolic_sizes`` marks the pools only while dynamo may trace and unmarks them after. Everything
else is static and guarded: a different dtype, device or cache width recompiles the family. Dynamo
guards nothing on the ``ForwardBatch`` argument: the traced code only passes it along.

Why ``backed_size_oblivious``: a backed size is otherwise specialized when it is 0 or 1 (a bs=1
DECODE key has T = 1), and a graph traced at T = 64 guards T >= 2, so the bs=1 key would compile a
second graph. Size-oblivious reasoning keeps 1 in the symbol's range without specializing on it.
It is patched around each call of the compiled family (dynamo traces and Inductor compiles inside
it), never set at import. It does not reach every decision: a view whose fake strides depend on
whether T is 1 still guards T >= 2, so a pass must not leave one (passes/README.md, invariant 5).

The backend re-traces dynamo's torch-level graph to ATen with ``make_fx`` (in dynamo's fake mode:
every tensor carries ``meta["val"]``, encore's custom ops appear as themselves, mutation as
mutation), runs encore's passes on it, and gives the result to Inductor. Inductor's FX-graph cache
keys on the graph after the passes, so what the passes did is part of every cache key without a
``CustomGraphPass.uuid``. A warm start reads Inductor's (and AOTAutograd's) work back from that
cache, but dynamo still traces, and the backend still re-traces, each family once per process.

Precompiled families: with an artifact directory (the graph cache's, graphs/cache.py) a family is
compiled through dynamo's ahead-of-time path (``torch.compile(...).aot_compile``; on torch 2.11,
which lacks that method, the ``aot_compile_fullgraph`` it runs): the same tracing, passes and
Inductor, but the result — dynamo's guards and bytecode together with Inductor's output — is saved
as one file per family, and a later process loads that file instead of tracing anything. On the
DeepSeek-V2-Lite shape the trace and the re-trace are most of a warm start's compile time (27
layers, three families), which Inductor's own caches cannot skip. The loaded function checks its
guards on every call; a call they reject runs the family's ordinary ``torch.compile`` entry, which
compiles (counted like a recompile), or eager for a step of no key; the first rejection of each family
is logged with dynamo's reason. An artifact that does not load is deleted with a warning and
compiled again; a family that cannot be precompiled (its guards reach an object that does not
serialize) is compiled the ordinary way, with a warning. A model drafter's graph
(``CompiledDrafter``) is precompiled and loaded the same way, one file beside the families'. What it
was compiled from must not change under it: the cache's identity covers the torch version and a
digest of encore's own sources, so any edit to the model, the passes or the ops starts a new cache.

Why a fresh code object per family: dynamo keeps its compiled entries, and its recompile limit, per
code object, so families sharing one entry function would evict each other past the limit; with one
each, a family compiles once and any later recompile (a guard that failed) is counted per family.
Recompiles are bounded: past ``max_compiles`` a family's backend stops compiling and hands dynamo's
graph back to run as it is (eager speed, still correct), so a guard that keeps failing cannot keep
the GPU waiting on the compiler.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch
from torch import fx
from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource
from torch._guards import detect_fake_mode
from torch.fx.experimental import _config as fx_config
from torch.fx.experimental.proxy_tensor import make_fx

from encore.backends.metadata import ForwardBatch, ForwardMode
from encore.backends.pdl import pdl_supported
from encore.graphs.keys import GraphKey

log = logging.getLogger(__name__)

# meta["step_size"] of the ATen graph input that binds the step's prefill-token count (MIXED graphs);
# passes find it with passes.fx_utils.step_size.
NUM_EXTEND_TOKENS = "num_extend_tokens"


class GraphPass(Protocol):
    """What passes/ provides: rewrite the graph in place, and say how many times it matched."""

    matches: int

    def __call__(self, graph: fx.Graph) -> None: ...


@dataclass(slots=True)
class CompileRecord:
    """What compiling one family cost. ``compiles`` counts the graphs the backend compiled, ``loaded``
    whether a precompiled one was read back instead (module docstring); more than one graph in all
    means a guard failed and dynamo recompiled. ``keys`` are the graph keys that have run on it."""

    compiles: int = 0
    loaded: bool = False
    seconds: float = 0.0
    matches: dict[str, int] = field(default_factory=dict)
    keys: set[GraphKey] = field(default_factory=set)


class EncoreBackend:
    """A dynamo backend for one family: ATen re-trace, encore's passes, then Inductor (or, with
    ``inductor=False``, the rewritten graph run as is — what pass tests use)."""

    def __init__(self, family: ForwardMode, passes: Sequence[GraphPass], record: CompileRecord,
                 inductor: bool = True, compile_threads: int | None = None, max_compiles: int = 2) -> None:
        self.family = family
        self.passes = tuple(passes)
        self.record = record
        self.inductor = inductor
        self.compile_threads = compile_threads
        self.max_compiles = max_compiles

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        start = time.perf_counter()
        self.record.compiles += 1
        if self.record.compiles + self.record.loaded > 1:
            log.warning("%s graph is being recompiled (compile #%d): a dynamo guard failed", self.family.value,
                        self.record.compiles)
        if self.record.compiles > self.max_compiles:
            log.warning("%s graph: past %d compiles, running dynamo's graph uncompiled", self.family.value,
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

            with inductor_config.patch(inductor_patches(example_inputs, self.compile_threads)):
                compiled = compile_fx(graph_module, example_inputs)
        else:
            compiled = graph_module
        self.record.seconds += time.perf_counter() - start
        return compiled


def inductor_patches(example_inputs: list, compile_threads: int | None) -> dict:
    """Inductor settings for one family's compile: its compile threads, and on sm90+ (Hopper) its
    kernels launched as programmatic dependents, so a launch overlaps the tail of the kernel before it
    (V2-Lite's bs-1 decode step, Triton attention, H200: 2.390 -> 2.303 ms; benchmarks/README.md).
    Such a kernel waits for the one before it before it loads a buffer that kernel's node wrote (else
    after its first load) and before it stores to one that node read or wrote (torch 2.13's codegen,
    ``_handle_pdl_before_access``): one that loads nothing and stores
    elsewhere does not wait, even into memory an op's temporaries just freed. So encore's own PDL
    kernels release the next kernel once they have read what may be freed when their op returns (the
    MoE's pair sum, after its loads), or where the next kernel is encore's own and waits at its top:
    the expert selection, after its wait and before it reads the router's logits (the MoE's first
    kernel follows it and writes nothing before it waits; one token's shared-expert programs read
    only x, complete by then, and weights), and the GEMV, before it reads x (and a fused norm's delta),
    and one token's MoE down kernel, as its weight reads end (its stores and pair sum follow), which
    stay safe while no load-free kernel follows a GEMV or the MoE. A kernel without PDL after one waits
    as usual."""
    patches: dict = {} if compile_threads is None else {"compile_threads": compile_threads}
    if any(isinstance(t, torch.Tensor) and pdl_supported(t.device) for t in example_inputs):
        patches["triton.enable_pdl"] = True
    return patches


def aten_graph(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
    """Re-traces dynamo's graph to ATen in dynamo's own fake mode (so views of one parameter storage
    stay views of one fake storage, which the pre-attention fusion relies on), and tags the input
    that binds the prefill-token count with ``meta["step_size"]``."""
    fake_mode = detect_fake_mode(example_inputs)
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fake_mode:
        module = make_fx(gm, tracing_mode="real")(*fakes)
    for node in module.graph.find_nodes(op="placeholder"):
        if any(map(_is_extend_ids_size, _sources(node.meta.get("val")))):
            node.meta["step_size"] = NUM_EXTEND_TOKENS
    return module


def _sources(value: object) -> list:
    """Where dynamo read a symbolic size input from (its shape environment records every source)."""
    if not isinstance(value, torch.SymInt):
        return []
    return value.node.shape_env.var_to_sources.get(value.node.expr, [])


def _is_extend_ids_size(source: object) -> bool:
    return (isinstance(source, TensorPropertySource) and source.prop is TensorProperty.SIZE and source.idx == 0
            and isinstance(source.base, LocalSource) and source.base.local_name == "extend_ids")


def _entry(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
           extend_ids: torch.Tensor | None) -> torch.Tensor:
    if extend_ids is not None:
        # The one use of the prefill-token count inside the graph (dynamo drops an input that nothing
        # uses): it keeps n a graph input for the dispatch split to cut at.
        torch._check(extend_ids.shape[0] < input_ids.shape[0])
    return model(input_ids, positions, batch)


def _draft_entry(forward: Callable, batch: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor
                 ) -> torch.Tensor:
    return forward(batch, input_ids, hidden)


def fresh_entry(entry: Callable = _entry) -> Callable:
    """A copy of ``entry`` with its own code object, hence its own dynamo cache (module docstring)."""
    return types.FunctionType(entry.__code__.replace(), entry.__globals__, "encore" + entry.__name__)


@contextmanager
def symbolic_sizes(pools: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Where a family's graph is traced and compiled: 0 and 1 stay in a size's range, and dim 0 of
    every KV pool in ``pools`` is marked dynamic, then unmarked (module docstring): dynamo has no unmark,
    and its marks are Python attributes of the tensor, so each pool gets back the attributes it had."""
    attributes = [dict(vars(pool)) for pool in pools]
    for pool in pools:
        torch._dynamo.mark_dynamic(pool, 0)
    try:
        with fx_config.patch(backed_size_oblivious=True):
            yield
    finally:
        for pool, before in zip(pools, attributes):
            vars(pool).clear()
            vars(pool).update(before)


def step_inputs(key: GraphKey, batch: ForwardBatch, mark: bool = True) -> tuple:
    """``_entry``'s arguments after the model for ``batch`` padded to ``key``, with the symbolic dims
    marked for dynamo unless ``mark`` is False (a precompiled graph is called with them unmarked)."""
    extend_ids = batch.input_ids[:key.num_extend_tokens] if key.mode is ForwardMode.MIXED else None
    if mark:
        for tensor in (batch.input_ids, batch.positions, extend_ids):
            if tensor is not None:
                torch._dynamo.mark_dynamic(tensor, 0)
    return batch.input_ids, batch.positions, batch, extend_ids


def _aot_compile_fullgraph() -> Callable | None:
    """Dynamo's ahead-of-time compile of a whole graph, or None where torch lacks it."""
    try:
        from torch._dynamo.aot_compile import aot_compile_fullgraph
    except ImportError:
        return None
    return aot_compile_fullgraph


def _saved_as_inductor_output(backend: EncoreBackend) -> Callable:
    """``backend`` with its Inductor output wrapped for saving: torch 2.13's ahead-of-time compile
    does that for any backend, 2.11's (which torch.compile does not expose as a method) only for
    Inductor's own."""
    from torch._dynamo.aot_compile import BundledAOTAutogradSerializableCallable

    def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Callable:
        compiled = backend(gm, example_inputs)
        return BundledAOTAutogradSerializableCallable(compiled) if hasattr(compiled, "serialize") else compiled

    return compile_graph


class CompiledFamily:
    """One family's compiled callable: ``entry`` (``_entry``: ``(model, ids, positions, batch, extend_ids)
    -> hidden``) through ``backend``, precompiled to (or loaded from) ``artifact`` when one is given and
    torch can (module docstring). Each call passes ``inputs(mark)``, the entry's arguments with their
    symbolic dims marked for dynamo when ``mark`` (a precompiled graph is called with them unmarked), and
    ``shape``, what the call is, for the warning when a precompiled graph's guards reject it. ``pools``:
    the KV pools the entry reaches, whose page count is symbolic too (module docstring)."""

    def __init__(self, backend: EncoreBackend, artifact: Path | None, entry: Callable = _entry,
                 pools: Sequence[torch.Tensor] = ()) -> None:
        self.backend = backend
        self.pools = pools
        self.entry = fresh_entry(entry)
        self.dynamo = torch.compile(self.entry, backend=backend, fullgraph=True, dynamic=False)
        self.artifact = artifact if _aot_compile_fullgraph() is not None else None
        self.precompiled: Callable | None = None
        self.rejected = False  # whether the precompiled graph's guards have rejected a call (warned once)

    def __call__(self, inputs: Callable[[bool], tuple], shape: object) -> torch.Tensor:
        if self.artifact is not None and self.precompiled is None:
            self.precompiled = self._load() or self._precompile(inputs)
        hidden = self._run_precompiled(inputs, shape)
        if hidden is not None:
            return hidden
        with symbolic_sizes(self.pools):
            return self.dynamo(*inputs(True))

    def run_built(self, inputs: Callable[[bool], tuple], shape: object) -> torch.Tensor | None:
        """Like calling it, but only on a graph already built whose guards pass; None where the call
        would compile (a step is never held up by the compiler)."""
        hidden = self._run_precompiled(inputs, shape)
        if hidden is not None:
            return hidden
        try:
            with symbolic_sizes(self.pools), torch.compiler.set_stance("fail_on_recompile"):
                return self.dynamo(*inputs(True))
        except RuntimeError as exc:
            if "fail_on_recompile" not in str(exc):
                raise
            return None

    def _run_precompiled(self, inputs: Callable[[bool], tuple], shape: object) -> torch.Tensor | None:
        """The precompiled graph's output, or None: there is none, or its guards reject the call."""
        if self.precompiled is None:
            return None
        args = inputs(False)
        if self.precompiled.guard_check(*args):
            return self.precompiled(*args)
        if not self.rejected:
            self.rejected = True
            failed = self.precompiled._artifacts.guard_manager.check_verbose(self.precompiled.prepare_f_locals(*args))
            log.warning("the precompiled %s graph's guards reject %s (%s): a step of a graph key "
                        "compiles the family again, one of no key runs eager (warned once per family)",
                        self.backend.family.value, shape, "; ".join(p.strip() for p in failed.verbose_code_parts))
        return None

    def _load(self) -> Callable | None:
        if not self.artifact.is_file():
            return None
        start = time.perf_counter()
        try:
            with self.artifact.open("rb") as f:
                precompiled = torch.compiler.load_compiled_function(f)
        except Exception as exc:  # noqa: BLE001 — any failure to deserialize means: rebuild, never use
            log.warning("precompiled %s graph %s does not load (%s: %s): deleting it and compiling again",
                        self.backend.family.value, self.artifact, type(exc).__name__, exc)
            self.artifact.unlink(missing_ok=True)
            return None
        precompiled.disable_guard_check()  # __call__ checks them first, and falls back to dynamo
        self.backend.record.loaded = True
        self.backend.record.seconds += time.perf_counter() - start
        return precompiled

    def _precompile(self, inputs: Callable[[bool], tuple]) -> Callable | None:
        """The family compiled ahead of time and saved; None (with a warning) where that fails, and
        then the ordinary entry compiles it for this process only."""
        compiles = self.backend.record.compiles
        try:
            with symbolic_sizes(self.pools):
                example = (inputs(True), {})
                if hasattr(self.dynamo, "aot_compile"):
                    precompiled = self.dynamo.aot_compile(example)
                else:
                    from torch._dynamo.hooks import Hooks

                    precompiled = _aot_compile_fullgraph()(self.entry, example, hooks=Hooks(), dynamic=False,
                                                           backend=_saved_as_inductor_output(self.backend))
            self.artifact.parent.mkdir(parents=True, exist_ok=True)
            precompiled.save_compiled_function(str(self.artifact))  # written atomically by torch
        except Exception as exc:  # noqa: BLE001 — whatever fails, the ordinary compile still serves
            log.warning("the %s graph cannot be precompiled (%s: %s): compiling it for this process only, so a "
                        "warm start will trace it again", self.backend.family.value, type(exc).__name__, exc)
            self.backend.record.compiles = compiles  # the ordinary compile that follows is the one that counts
            self.artifact = None
            return None
        precompiled.disable_guard_check()
        return precompiled


class CompiledModel:
    """One compiled callable per family (``key.mode``), compiled on the family's first key.

    ``passes_for(family)`` builds the family's pass list (passes are specialized by family). With
    ``artifacts`` (a directory) and Inductor on, each family is precompiled there, or loaded from
    there when an earlier process did it (module docstring). ``pools``: the model's KV pools."""

    def __init__(self, model: torch.nn.Module, passes_for: Callable[[ForwardMode], Sequence[GraphPass]],
                 inductor: bool = True, compile_threads: int | None = None, artifacts: Path | None = None,
                 pools: Sequence[torch.Tensor] = ()) -> None:
        self.model = model
        self.pools = pools
        self.passes_for = passes_for
        self.inductor = inductor
        self.compile_threads = compile_threads
        self.artifacts = artifacts if inductor else None  # a graph run as is does not serialize
        self.records: dict[ForwardMode, CompileRecord] = {}
        self._compiled: dict[ForwardMode, CompiledFamily] = {}

    def __call__(self, key: GraphKey, batch: ForwardBatch) -> torch.Tensor:
        """Runs ``batch`` (already padded to ``key``, bound in the step context) -> hidden [T, hidden]."""
        family = key.mode
        step = self._compiled.get(family)
        if step is None:
            record = self.records[family] = CompileRecord()
            backend = EncoreBackend(family, self.passes_for(family), record, self.inductor, self.compile_threads)
            artifact = self.artifacts / f"{family.value.lower()}.aot" if self.artifacts is not None else None
            step = self._compiled[family] = CompiledFamily(backend, artifact, pools=self.pools)
        self.records[family].keys.add(key)
        return step(self._inputs(key, batch), key)

    def run_unkeyed(self, shape: GraphKey, batch: ForwardBatch) -> torch.Tensor | None:
        """Runs ``batch``, which no graph key holds (``shape``: its own sizes), unpadded on its family's
        graph, which a key of that family built; not counted among the compiled keys. None where that
        graph's guards reject the step: it is not compiled for it (the caller runs it eager)."""
        return self._compiled[shape.mode].run_built(self._inputs(shape, batch), shape)

    def _inputs(self, key: GraphKey, batch: ForwardBatch) -> Callable[[bool], tuple]:
        return lambda mark: (self.model, *step_inputs(key, batch, mark))

    @property
    def compiled_keys(self) -> int:
        """Graph keys that have run compiled (each on its family's graph)."""
        return sum(len(r.keys) for r in self.records.values())

    @property
    def compiled_graphs(self) -> int:
        """Graphs dynamo traced and handed the backend: one per family, plus its recompiles (past
        ``max_compiles`` those run uncompiled)."""
        return sum(r.compiles for r in self.records.values())

    @property
    def loaded_graphs(self) -> int:
        """Families whose graph was read back precompiled instead of traced and compiled."""
        return sum(r.loaded for r in self.records.values())

    @property
    def recompiles(self) -> int:
        return sum(max(r.compiles + r.loaded - 1, 0) for r in self.records.values())


def _inference_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as an inference tensor under inference mode: a view of itself made in that mode is one."""
    if torch.is_inference_mode_enabled() and not tensor.is_inference():
        return tensor.view(tensor.dtype)
    return tensor


class CompiledDrafter:
    """A model drafter's pass (``forward(batch, input_ids, hidden)``, engine/spec/drafters.py) compiled
    once for DECODE steps: the first pass over a verify step's 1 + k tokens per row and each q_len-1
    draft step run the same graph, their token count symbolic (ids, positions and the fed states
    marked dynamic, and so are the rows of the slot mapping and page table, which EAGLE-3's attention
    op takes) and the passes specialized to the DECODE family. Only decode-only steps may call it; a
    pass over prefill rows runs eager. With ``artifact`` (a file in the graph cache) it is precompiled
    there, or loaded from there, as a family is (module docstring); ``pools``: the KV pools it reaches."""

    def __init__(self, forward: Callable, passes: Sequence[GraphPass], inductor: bool = True,
                 compile_threads: int | None = None, artifact: Path | None = None,
                 pools: Sequence[torch.Tensor] = ()) -> None:
        self.forward = forward
        self.record = CompileRecord()
        backend = EncoreBackend(ForwardMode.DECODE, passes, self.record, inductor, compile_threads)
        self._family = CompiledFamily(backend, artifact if inductor else None, entry=_draft_entry, pools=pools)

    def __call__(self, batch: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if batch.num_extends:
            raise ValueError(f"the compiled drafter runs decode-only steps; this one has {batch.num_extends} "
                             "prefill rows")
        # Dynamo guards a tensor's dispatch keys, and under inference mode (where the engine drafts) a
        # first pass fed views of the graph buffers (ordinary tensors) differs there from a draft step
        # fed tensors made in that mode (inference tensors): each would compile its own graph. Every
        # input goes in as an inference tensor (a view of itself, no copy).
        input_ids, hidden = _inference_alias(input_ids), _inference_alias(hidden)
        batch = replace(batch, positions=_inference_alias(batch.positions),
                        slot_mapping=_inference_alias(batch.slot_mapping),
                        page_table=_inference_alias(batch.page_table))

        def inputs(mark: bool) -> tuple:
            if mark:
                for tensor in (input_ids, batch.positions, hidden, batch.slot_mapping, batch.page_table):
                    torch._dynamo.mark_dynamic(tensor, 0)
            return self.forward, batch, input_ids, hidden

        return self._family(inputs, f"a draft pass of {input_ids.shape[0]} tokens")
