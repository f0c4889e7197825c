"""The per-family compile driver: one dynamo cache per family, shared by its keys' sizes; recompiles
counted and bounded per family."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest
import torch
from torch import nn

from encore.backends.metadata import ForwardMode
from encore.engine import Engine
from encore.engine.spec.speculator import _later_draft_steps
from encore.graphs.compiler import CompiledDrafter, CompiledModel, inductor_patches
from encore.graphs.keys import GraphKey
from encore.graphs.padding import StepBuffers
from encore.passes.pipeline import passes_for
from checkpoints import EAGLE3_SHAPE, write_eagle3_checkpoint


class Doubler(nn.Module):
    def forward(self, input_ids, positions, batch):
        return input_ids * 2 + positions


class Batch:
    def __init__(self, tokens: int, dtype: torch.dtype = torch.int64) -> None:
        self.input_ids = torch.arange(tokens, dtype=dtype)
        self.positions = torch.zeros(tokens, dtype=dtype)


class CountingPass:
    def __init__(self, runs: list) -> None:
        self.runs = runs
        self.matches = 0

    def __call__(self, graph) -> None:
        self.runs.append(graph)


def test_a_family_compiles_once_for_all_its_sizes_and_recompiles_are_counted_then_bounded():
    runs = []
    compiled = CompiledModel(Doubler(), lambda family: [CountingPass(runs)], inductor=False)
    decodes = [GraphKey(0, 1, bs, bs) for bs in (8, 4, 2, 1)] + [GraphKey(0, 3, 2, 6)]  # bs 1 too: T = 1
    extend = GraphKey(1, 1, 1, 4)
    for key in (*decodes, extend, *decodes):
        assert compiled(key, Batch(key.num_tokens)).tolist() == [2 * i for i in range(key.num_tokens)]
    assert compiled.compiled_keys == 6 and compiled.compiled_graphs == 2 and compiled.recompiles == 0
    for dtype in (torch.int32, torch.int16, torch.float32):  # each fails a dtype guard of the DECODE graph
        assert compiled(decodes[0], Batch(8, dtype)).tolist() == [2 * i for i in range(8)]
    assert compiled.records[ForwardMode.DECODE].compiles == 4 and compiled.recompiles == 3
    assert compiled.records[ForwardMode.EXTEND].compiles == 1
    assert len(runs) == 2 + 1  # DECODE compiled twice (the bound), then ran uncompiled; EXTEND once


def drafter_engine(method: str, checkpoint, tmp_path) -> tuple[Engine, int]:
    """A CPU engine drafting with ``method`` (encore-tiny's MTP layer, or an EAGLE-3 drafter over the tiny
    V3), and the width of the states its drafter is fed."""
    if method == "mtp":
        engine = Engine(device="cpu", page_size=4, speculative={"method": "mtp", "num_speculative_tokens": 2})
        return engine, engine.model_config.hidden_size
    drafter = write_eagle3_checkpoint(tmp_path)
    engine = Engine(str(checkpoint("v3")), device="cpu", page_size=4,
                    speculative={"method": "eagle3", "num_speculative_tokens": 2, "draft_model": str(drafter)})
    return engine, EAGLE3_SHAPE["hidden_size"]


def draft_steps(engine: Engine, width: int, row_counts: tuple[int, ...], seed: int) -> list[tuple]:
    """(batch, ids, hidden) of a draft's second step (a q_len-1 decode step at the first draft's
    position + 1) for each row count, on random positions, ids and fed states."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for rows in row_counts:
        table = 1 + torch.arange(rows * 4, dtype=torch.int32).view(rows, 4)
        positions = torch.randint(3, 15, (rows,), generator=gen)
        ids = torch.randint(0, engine.model_config.vocab_size, (rows,), generator=gen)
        hidden = torch.randn(rows, width, generator=gen)
        batch = next(_later_draft_steps(positions - 1, table, 4, torch.arange(1, 3)[:, None], [ids]))
        steps.append((batch, ids, hidden))
    return steps


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_compiled_drafter_matches_the_eager_pass_at_every_step_size(method, checkpoint, tmp_path):
    """A drafter's pass compiled once (DECODE family, token count and rows symbolic) gives the eager
    pass's states at three step sizes (a q_len-1 draft step of 4 rows, 2 and 1), and refuses prefill
    rows: the MTP layer (attention through the step context) and EAGLE-3's layer (its own attention
    op over the batch's tensors)."""
    engine, width = drafter_engine(method, checkpoint, tmp_path)
    speculator = engine.speculator
    compiled = CompiledDrafter(speculator.model_drafter.forward, passes_for(ForwardMode.DECODE), compile_threads=1)
    for batch, ids, hidden in draft_steps(engine, width, (4, 2, 1), seed=0):
        with torch.inference_mode():
            want = speculator._drafter_pass(speculator.model_drafter.forward, batch, ids, hidden)
            got = speculator._drafter_pass(compiled, batch, ids, hidden)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert compiled.record.compiles == 1
    if method == "mtp":
        assert compiled.record.matches["MlaDispatchSplit"] == 1
    prefill = replace(batch, num_extends=1)
    with pytest.raises(ValueError, match="decode-only steps; this one has 1 prefill rows"):
        compiled(prefill, ids, hidden)


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_a_precompiled_drafter_is_loaded_by_the_next_start(method, checkpoint, tmp_path):
    """With an artifact, the first drafter compiles and saves its graph; a second one (a later start)
    loads it, compiles nothing, and gives the eager pass's states at two step sizes."""
    engine, width = drafter_engine(method, checkpoint, tmp_path)
    speculator = engine.speculator
    artifact = tmp_path / "precompiled" / "drafter.aot"
    passes = draft_steps(engine, width, (3, 1), seed=1)
    for start in ("cold", "warm"):
        compiled = CompiledDrafter(speculator.model_drafter.forward, passes_for(ForwardMode.DECODE), compile_threads=1,
                                   artifact=artifact)
        with torch.inference_mode():
            for batch, ids, hidden in passes:
                want = speculator._drafter_pass(speculator.model_drafter.forward, batch, ids, hidden)
                got = speculator._drafter_pass(compiled, batch, ids, hidden)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert artifact.is_file()
        assert (compiled.record.compiles, compiled.record.loaded) == ((1, False) if start == "cold" else (0, True))


def test_compiled_drafter_compiles_once_for_a_graph_steps_first_pass_and_its_draft_steps():
    """As a draft graph runs it (under inference mode): the first pass over a verify key's static step
    (views of the graph buffers, positions and slots far into them) and the k - 1 draft steps built on the
    device (tensors made in inference mode, a row of them at storage offset 0 or 1 unless kept past it),
    at bs 4 and bs 1: one graph for all, each pass equal to the eager one."""
    engine = Engine(device="cpu", page_size=4, speculative={"method": "mtp", "num_speculative_tokens": 3})
    speculator, hidden_size = engine.speculator, engine.model_config.hidden_size
    compiled = CompiledDrafter(speculator.model_drafter.forward, passes_for(ForwardMode.DECODE), compile_threads=1)
    buffers = StepBuffers(16, 4, 8, 4, torch.device("cpu"), full_page_table=True)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for bs in (4, 1):
            static = buffers.fill(GraphKey(0, 4, bs, 4 * bs), None)
            passes = [(static, static.input_ids, torch.randn(4 * bs, hidden_size, generator=gen))]
            first = torch.arange(bs) * 4
            drafts = [static.input_ids[first]]
            for step in _later_draft_steps(static.positions[first], static.page_table, 4, torch.arange(1, 4)[:, None],
                                           drafts):
                passes.append((step, step.input_ids, torch.randn(bs, hidden_size, generator=gen)))
                drafts.append(drafts[-1] + 1)
            for batch, ids, hidden in passes:
                want = speculator._drafter_pass(speculator.model_drafter.forward, batch, ids, hidden)
                got = speculator._drafter_pass(compiled, batch, ids, hidden)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert compiled.record.compiles == 1

def test_a_loaded_graph_whose_guards_reject_a_call_falls_back_to_dynamo_as_a_recompile(tmp_path, caplog):
    """A precompiled family read back in a new CompiledModel serves the sizes it was compiled for;
    a call its guards reject (another dtype) is compiled by dynamo, warned about and counted."""
    key = GraphKey(0, 1, 8, 8)
    first = CompiledModel(Doubler(), lambda family: [], compile_threads=1, artifacts=tmp_path)
    assert first(key, Batch(8)).tolist() == [2 * i for i in range(8)]
    assert first.compiled_graphs == 1 and (tmp_path / "decode.aot").is_file()
    loaded = CompiledModel(Doubler(), lambda family: [], compile_threads=1, artifacts=tmp_path)
    for tokens in (8, 3):
        assert loaded(GraphKey(0, 1, tokens, tokens), Batch(tokens)).tolist() == [2 * i for i in range(tokens)]
    assert loaded.loaded_graphs == 1 and loaded.compiled_graphs == 0 and loaded.recompiles == 0
    with caplog.at_level(logging.WARNING, logger="encore.graphs.compiler"):
        assert loaded(key, Batch(8, torch.int32)).tolist() == [2 * i for i in range(8)]
    assert loaded.compiled_graphs == 1 and loaded.recompiles == 1
    assert "DECODE graph is being recompiled" in caplog.text


class Handle:
    """Stands in for a kernel handle (flashinfer's JIT modules): readable, but it does not pickle."""

    def __init__(self) -> None:
        self.scale = 2
        self.lock = threading.Lock()


class ReadsHandle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.handle = Handle()

    def forward(self, input_ids, positions, batch):
        return input_ids * self.handle.scale + positions  # dynamo guards on the handle: it must be saved


def test_a_family_that_cannot_be_precompiled_is_compiled_for_the_process_with_a_warning(tmp_path, caplog):
    compiled = CompiledModel(ReadsHandle(), lambda family: [], compile_threads=1, artifacts=tmp_path)
    with caplog.at_level(logging.WARNING, logger="encore.graphs.compiler"):
        for tokens in (8, 3):
            got = compiled(GraphKey(0, 1, tokens, tokens), Batch(tokens))
            assert got.tolist() == [2 * i for i in range(tokens)]
    assert "DECODE graph cannot be precompiled" in caplog.text and "lock" in caplog.text
    assert caplog.text.count("cannot be precompiled") == 1  # tried once per family
    assert not (tmp_path / "decode.aot").exists()
    assert compiled.compiled_graphs == 1 and compiled.recompiles == 0 and compiled.loaded_graphs == 0


@pytest.mark.parametrize("precompiled", [False, True])
def test_a_step_no_key_holds_runs_on_the_built_graph_and_never_compiles(tmp_path, precompiled):
    """Unkeyed steps (graphs/runner.py) run on the family's graph at their own size; one its guards
    reject (another dtype) gets None, for the caller to run eager, and compiles nothing."""
    key = GraphKey(0, 1, 8, 8)
    artifacts = tmp_path if precompiled else None
    compiled = CompiledModel(Doubler(), lambda family: [], compile_threads=1, artifacts=artifacts)
    if precompiled:
        CompiledModel(Doubler(), lambda family: [], compile_threads=1, artifacts=artifacts)(key, Batch(8))
    compiled(key, Batch(8))
    assert compiled.run_unkeyed(GraphKey(0, 1, 5, 5), Batch(5)).tolist() == [2 * i for i in range(5)]
    assert compiled.run_unkeyed(GraphKey(0, 1, 5, 5), Batch(5, torch.int32)) is None
    assert compiled.compiled_keys == 1 and compiled.recompiles == 0
    assert (compiled.loaded_graphs, compiled.compiled_graphs) == ((1, 0) if precompiled else (0, 1))


def test_inductor_patches_turn_on_pdl_only_for_hopper_inputs():
    cpu = [torch.zeros(2), 3]  # a tensor and a size, as dynamo hands a backend its example inputs
    assert inductor_patches(cpu, None) == {}
    assert inductor_patches(cpu, 1) == {"compile_threads": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_patches_turn_on_pdl_on_sm90_gpu():
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert inductor_patches([3, torch.zeros(2, device="cuda")], None) == ({"triton.enable_pdl": True} if hopper else {})
