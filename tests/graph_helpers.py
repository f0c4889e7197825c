"""Helpers for graph and pass tests: real steps of every mode on a tiny engine, and a test backend
that runs passes on a family's graph, keeps the graph before and after each, and executes the result."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch import fx

from encore.backends.metadata import ForwardBatch
from encore.engine import Engine, SamplingParams
from encore.engine.request import Request
from encore.engine.scheduler import ScheduledStep
from encore.engine.step import build_forward_batch
from encore.graphs.compiler import CompiledFamily, aten_graph, step_inputs
from encore.graphs.keys import GraphKey
from encore.graphs.padding import StepBuffers, padded_index
from workloads import run_staggered


def engine_with_history(path, device: str = "cpu", **options) -> tuple[Engine, dict[str, ForwardBatch]]:
    """An engine (float32 unless ``options`` say otherwise) where two requests have prefilled all but
    their last prompt token, and one (unpadded) step of each mode built on top of it, not yet run:
    EXTEND: a new 5-token prompt; DECODE: the two requests' next token; MIXED: both together."""
    engine = Engine(str(path), device=device, **{"dtype": "float32", "page_size": 4, **options})
    a = Request("a", list(range(10, 19)), SamplingParams(), 0, None)
    b = Request("b", list(range(30, 45)), SamplingParams(), 0, None)
    c = Request("c", list(range(50, 55)), SamplingParams(), 0, None)
    history = _batch(engine, [(a, 8), (b, 14)], [])
    engine.runner.forward(history)
    a.num_computed, b.num_computed = 8, 14
    batches = {
        "EXTEND": _batch(engine, [(c, 5)], []),
        "DECODE": _batch(engine, [], [a, b]),
        "MIXED": _batch(engine, [(c, 5)], [a, b]),
    }
    return engine, batches


def _batch(engine: Engine, extends: list[tuple[Request, int]], decodes: list[Request]) -> ForwardBatch:
    for req, n in extends:
        assert engine.kv.reserve(req.request_id, req.num_computed + n)
    for req in decodes:
        assert engine.kv.reserve(req.request_id, req.num_computed + 1)
    batch, _ = build_forward_batch(ScheduledStep(extends=extends, decodes=decodes), engine.kv, engine.runner.device)
    return batch


# Keys that pad each mode's step above: more prefill tokens, more decode rows than the step has.
PADDED_KEYS = {
    "EXTEND": GraphKey(1, 1, 1, 8),
    "DECODE": GraphKey(0, 1, 4, 4),
    "MIXED": GraphKey(1, 1, 4, 8 + 3),
}


def op_counts(graph: fx.Graph) -> collections.Counter:
    return collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")


@dataclass
class Snapshot:
    """A 'pass' that keeps a copy of each graph it sees."""

    graphs: list[fx.Graph] = field(default_factory=list)
    matches: int = 0

    def __call__(self, graph: fx.Graph) -> None:
        copy = fx.Graph()
        copy.output(copy.graph_copy(graph, {}))
        self.graphs.append(copy)


def _clone(module: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph._codegen = module.graph._codegen
    graph.output(graph.graph_copy(module.graph, {}))  # node meta (fake values) is copied along
    return fx.GraphModule(module, graph)


@dataclass
class Stage:
    """One pass of a pipeline run: the graph before and after it, its match count, and what the
    graph after it computes for the step's real tokens."""

    name: str
    matches: int
    before: fx.Graph
    after: fx.Graph
    hidden: torch.Tensor | None = None

    @property
    def counts_before(self) -> collections.Counter:
        return op_counts(self.before)

    @property
    def counts_after(self) -> collections.Counter:
        return op_counts(self.after)


class StagedBackend:
    """A test backend: re-traces to ATen like EncoreBackend, runs the passes one at a time keeping a
    runnable copy of the graph after each, and runs every copy on the step's real inputs."""

    def __init__(self, passes: list) -> None:
        self.passes = passes
        self.stages: list[Stage] = []
        self.modules: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        module = aten_graph(gm, example_inputs)
        for graph_pass in self.passes:
            after = _clone(module)
            graph_pass(after.graph)
            after.graph.lint()
            after.recompile()
            self.stages.append(Stage(type(graph_pass).__name__, graph_pass.matches, module.graph, after.graph))
            self.modules.append(after)
            module = after

        def run(*args):
            outputs = [m(*args) for m in self.modules]  # each re-writes the same cache slots with the same values
            for stage, out in zip(self.stages, outputs):
                stage.hidden = out[0] if isinstance(out, (tuple, list)) else out
            return outputs[-1]

        return run


@dataclass
class PipelineRun:
    stages: dict[str, Stage]
    eager: torch.Tensor  # [batch.num_tokens, hidden] from the eager model on the unpadded step


def run_pipeline(engine: Engine, batch: ForwardBatch, key: GraphKey, passes: list) -> PipelineRun:
    """Traces the model for ``key``'s family as the compiler does (sizes symbolic), runs ``passes`` in
    order (a Stage each), executes every stage's graph on ``batch`` padded to ``key``, and the eager
    model on ``batch``."""
    backend = StagedBackend(passes)
    buffers = StepBuffers(key.num_tokens, key.bs, engine.runner.max_pages_per_row, batch.page_size,
                          engine.runner.device, full_page_table=False)
    padded = buffers.fill(key, batch)
    step = CompiledFamily(backend, None)
    real = padded_index(batch, key, torch.arange(batch.num_tokens, device=batch.input_ids.device))
    with torch.inference_mode():
        with engine.runner.context.bind(padded):
            step(lambda mark: (engine.runner.model, *step_inputs(key, padded, mark)), key)
        eager = engine.runner.forward(batch)
    for stage in backend.stages:
        stage.hidden = stage.hidden[real]
    return PipelineRun({s.name: s for s in backend.stages}, eager)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[7 + i * 3 + j for j in range(5 + 4 * i)] for i in range(6)]
ARRIVAL_STEP = [0, 0, 2, 3, 5, 9]
# With these settings the staggered arrivals produce EXTEND, MIXED and DECODE steps. The SMALL_KEYS
# keys — DECODE(4 rows), MIXED(1 prefill row, 8-token bucket, 4 decode rows), EXTEND(2 rows, 8
# tokens) — hold some of each, most of them padded (1-3 decode rows, 4-5 prefill tokens); the rest
# run eager (MIXED steps with 2-3 prefill rows or 5 decode rows).
STAGGERED = dict(page_size=4, chunked_prefill_size=4, max_num_batched_tokens=12)
SMALL_KEYS = dict(graph_decode_sizes=(4,), graph_mixed_extends=(1,), graph_mixed_decode_sizes=(4,),
                  graph_prefill_tokens=(8,), graph_extend_sizes=(2,))


def staggered(engine: Engine) -> dict[str, list[int]]:
    """Requests arriving over several steps (as in tests/engine/test_mixed.py); greedy tokens by id."""
    return {rid: out.token_ids for rid, out in run_staggered(engine, PROMPTS, GREEDY, ARRIVAL_STEP).items()}