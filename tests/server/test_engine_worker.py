"""EngineLoop with a stand-in engine, without a process: it steps on while nobody reads its outputs,
and each step's outputs arrive as one message with every delta, in order, with the engine's stats
once per STATS_INTERVAL_S and after the last step; the engine's description
names its captured graph keys, and GetServerInfo reports them. The worker freezes its start-up heap
before it reports ready."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import threading
from types import SimpleNamespace

import pytest

from encore.engine import Engine, RequestOutput
from encore.graphs.keys import GraphKey
from encore.protos.encore.v1 import generate_pb2 as pb
from encore.server import engine_worker
from encore.server.config import ServerConfig
from encore.server.engine_worker import EngineLoop, _run, captured_keys
from encore.server.message_pipe import MessageReader, MessageWriter
from encore.server.messages import EngineInfo, Ready, Shutdown, StepResult
from encore.server.metrics import ServerMetrics
from encore.server.servicer import GenerationServicer

STEPS, ROWS, TOKENS = 20, 8, 500  # ~200 kB of outputs: several times a pipe's buffer


class _Stepper:
    """Stands in for Engine: ROWS requests that get TOKENS tokens a step and finish at step STEPS,
    when it sends the loop a Shutdown."""

    def __init__(self, commands: MessageWriter) -> None:
        self.commands = commands
        self.requests = {}
        self.done = 0

    def has_unfinished_requests(self) -> bool:
        return self.done < STEPS

    def step(self) -> list[RequestOutput]:
        self.done += 1
        finished = self.done == STEPS
        if finished:
            self.commands.send(Shutdown())
        return [RequestOutput(f"r{row}", [], [], 0, "", [self.done * 1000 + row] * TOKENS, "", finished,
                              "length" if finished else None) for row in range(ROWS)]

    def stats(self) -> dict:
        return {"steps": {"DECODE": self.done}, "kv_pages_free": 1, "kv_pages_total": 2, "running": ROWS,
                "waiting": 0, "preemptions": 0, "kv_pages_cached": 0, "prefix_cache_query_tokens": 0,
                "prefix_cache_hit_tokens": 0, "overlapped_steps": 0, "step_seconds": 0.0}


@pytest.mark.parametrize("interval", [0.0, 3600.0])
def test_the_loop_steps_on_while_its_outputs_wait_and_every_delta_arrives_in_order(monkeypatch, interval):
    """Stats: with every step at interval 0; with an interval longer than the run, with the first step
    and with the last (the engine idle after it), and none between."""
    monkeypatch.setattr(engine_worker, "STATS_INTERVAL_S", interval)
    command_reader, command_writer = multiprocessing.Pipe(duplex=False)
    output_reader, output_writer = multiprocessing.Pipe(duplex=False)
    engine = _Stepper(MessageWriter(command_writer))
    loop = EngineLoop(engine, MessageReader(command_reader), MessageWriter(output_writer))
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive() and engine.done == STEPS  # it never waited for a reader
    assert loop.outbox.pending  # what the pipe could not take waits in the writer

    outputs, results = MessageReader(output_reader), []
    while len(results) < STEPS:
        results += outputs.read()
        loop.outbox.flush()
    assert all(isinstance(r, StepResult) for r in results)
    assert [[(d.request_id, d.token_ids, d.finish_reason) for d in r.deltas] for r in results] == [
        [(f"r{row}", [step * 1000 + row] * TOKENS, "length" if step == STEPS else None) for row in range(ROWS)]
        for step in range(1, STEPS + 1)]
    with_stats = [r.stats.steps["DECODE"] if r.stats is not None else None for r in results]
    if interval == 0.0:
        assert with_stats == list(range(1, STEPS + 1))
    else:
        assert with_stats == [1] + [None] * (STEPS - 2) + [STEPS]


def test_server_info_lists_the_captured_graph_keys_only():
    """``GetServerInfo.graph_keys``: every key once CUDA graphs are captured; none when steps only
    compile (or run eager)."""
    keys = (GraphKey(1, 1, 5, 12), GraphKey(0, 1, 4, 4))
    for cuda_graphs, want in ((True, ((1, 1, 5, 12), (0, 1, 4, 4))), (False, ())):
        engine = SimpleNamespace(runner=SimpleNamespace(graphs=SimpleNamespace(cuda_graphs=cuda_graphs, keys=keys)))
        assert captured_keys(engine) == want
    assert captured_keys(SimpleNamespace(runner=SimpleNamespace(graphs=None))) == ()


def test_server_info_reports_each_graph_key_field_by_field():
    keys = ((1, 1, 5, 12), (0, 3, 8, 24))
    info = EngineInfo(model="m", architecture="a", vocab_size=8, max_model_len=64, num_hidden_layers=1,
                      hidden_size=8, num_attention_heads=1, kv_lora_rank=8, qk_rope_head_dim=4, eos_token_ids=(),
                      max_num_seqs=4, page_size=16, engine_config={}, graph_keys=keys)
    engine = SimpleNamespace(info=info, stats=None, failure=None, ready=True, streams={})
    servicer = GenerationServicer(ServerConfig(), engine, None, ServerMetrics())
    reply = asyncio.run(servicer.GetServerInfo(pb.GetServerInfoRequest(), context=None))
    assert [(k.num_extends, k.q_len_per_req, k.bs, k.num_tokens) for k in reply.graph_keys] == list(keys)


def test_the_worker_freezes_its_start_up_heap_before_it_reports_ready(checkpoint):
    """What start-up leaves alive goes to the collector's permanent generation, so that no collection
    in a step walks it (``freeze_start_up_heap``); then Ready, then the loop (here: told to stop)."""
    command_reader, command_writer = multiprocessing.Pipe(duplex=False)
    output_reader, output_writer = multiprocessing.Pipe(duplex=False)
    MessageWriter(command_writer).send(Shutdown())
    frozen = gc.get_freeze_count()
    try:
        _run({"model": str(checkpoint("v3")), "device": "cpu"}, MessageReader(command_reader),
             MessageWriter(output_writer), Engine)
        assert gc.get_freeze_count() > frozen + 10_000  # the model, its modules, torch's and encore's imports
    finally:
        gc.unfreeze()
    messages = MessageReader(output_reader).read()
    assert isinstance(messages[-1], Ready), messages
