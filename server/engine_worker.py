"""The engine process: builds the Engine, then steps it for as long as it has work.

Commands arrive on ``inbox`` and are applied between steps: the loop waits for one only while the
engine is idle, and otherwise takes whatever has arrived without blocking, so request handling
never stalls a step. Each step's outputs leave on ``outbox`` as one ``StepResult``, pickled and
written by the loop itself without blocking (``message_pipe``): the engine goes on stepping while
earlier outputs are still in flight, and a slow reader in the server never blocks it. The engine's
stats ride along once per ``STATS_INTERVAL_S`` and whenever the engine has gone idle. The server
process closing its end of the command pipe (it exited) ends the loop.

The engine runs with ``detokenize=False``: the server process tokenizes prompts, detokenizes
the streamed ids and matches stop strings (see ``request_stream``), which keeps that Python work
off the step loop. The engine still stops on EOS, stop token ids and length by itself.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import select
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from encore.engine import Engine, RequestOutput, SamplingParams
from encore.engine.request import RequestStatus
from encore.server.message_pipe import MessageReader, MessageWriter
from encore.server.messages import (
    Abort, EngineInfo, EngineStats, Fatal, Progress, Ready, Rejected, Shutdown, StepFailed, StepResult, Submit,
)

log = logging.getLogger(__name__)

_DRAIN_S = 10.0  # at exit, how long the last outputs may wait for the server to read them
# While the engine is busy, its stats go out with one step in this many seconds (and with every step
# after which it is idle); only GetServerInfo and a metrics scrape read them. Sent with every step,
# reading and pickling them made the loop's median time between two steps 50-54 us against 30-36 us
# (an H100 host, one encore-tiny stream; benchmarks/README.md, "gRPC server overhead").
STATS_INTERVAL_S = 0.05


def run_engine(engine_kwargs: dict, commands: Connection, outputs: Connection,
               engine_factory: Callable[..., Engine] = Engine) -> None:
    """The engine process's work (``engine_spawn`` starts it); ``commands`` and ``outputs`` are its ends
    of the pipes."""
    logging.basicConfig(level=logging.WARNING, format="encore engine: %(levelname)s %(message)s")
    outbox = MessageWriter(outputs)
    try:
        _run(engine_kwargs, MessageReader(commands), outbox, engine_factory)
    finally:
        outbox.drain(_DRAIN_S)  # a Fatal must reach the server before the process is gone


def _run(engine_kwargs: dict, inbox: MessageReader, outbox: MessageWriter,
         engine_factory: Callable[..., Engine]) -> None:
    """Builds and warms up the engine, then steps it; a failure goes to the server as ``Fatal``."""
    try:
        outbox.send(Progress(f"loading {engine_kwargs.get('model')} and preparing its graphs"))
        def on_graph_key(done: int, total: int, report) -> None:
            outbox.send(Progress(f"graph key {done}/{total} {report.key}: compiled in {report.compile_s:.1f}s, "
                                 f"captured in {report.capture_s:.2f}s"))

        # The server detokenizes (module docstring).
        engine = engine_factory(**engine_kwargs, detokenize=False, on_graph_key=on_graph_key,
                                on_progress=lambda line: outbox.send(Progress(line)))
        outbox.send(Progress("warming up (one prefill and one decode step)"))
        engine.generate([[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        freeze_start_up_heap()
    except Exception as exc:
        log.exception("engine start failed")
        outbox.send(Fatal(f"engine start failed: {type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    outbox.send(Ready(engine_info(engine), engine_stats(engine)))
    try:
        EngineLoop(engine, inbox, outbox).run()
    except Exception as exc:
        log.exception("engine loop failed")
        outbox.send(Fatal(f"{type(exc).__name__}: {exc}"))
        raise


def freeze_start_up_heap() -> None:
    """Collects the garbage start-up left, then moves every object still alive (the model, compiled
    graphs, caches, imports: ~0.5 M objects with encore-tiny) into the collector's permanent generation,
    where no later collection walks it; they live as long as the process. Without this, a prompt
    step early in serving paid for start-up's garbage: on an H200, in each of three runs of three waves
    of 64 prompts on a fresh encore-tiny engine, one wave's first step took 41-45 ms against 6-10 ms
    for the others; in a run with it, 6-8 ms for each."""
    gc.collect()
    gc.freeze()


def engine_info(engine: Engine) -> EngineInfo:
    cfg = engine.model_config
    return EngineInfo(
        model=engine.config.model, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
        max_model_len=engine.max_model_len, num_hidden_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, eos_token_ids=tuple(sorted(engine.eos_token_ids)),
        max_num_seqs=engine.config.max_num_seqs, page_size=engine.config.page_size,
        engine_config={k: str(v) for k, v in dataclasses.asdict(engine.config).items()},
        speculative_method=engine.config.speculative.method if engine.config.speculative is not None else None,
        graph_keys=captured_keys(engine),
    )


def captured_keys(engine: Engine) -> tuple[tuple[int, int, int, int], ...]:
    """The keys of the engine's captured CUDA graphs (all its keys are captured at start-up)."""
    graphs = engine.runner.graphs
    if graphs is None or not graphs.cuda_graphs:
        return ()
    return tuple((k.num_extends, k.q_len_per_req, k.bs, k.num_tokens) for k in graphs.keys)


def engine_stats(engine: Engine) -> EngineStats:
    stats = engine.stats()
    steps = dict(stats["steps"])
    # Read with defaults what not every engine build reports: the graph runner's counters (without
    # it every step is eager), its captured keys, and speculative decoding's counts (when it is on).
    return EngineStats(
        steps=steps, kv_pages_free=stats["kv_pages_free"], kv_pages_total=stats["kv_pages_total"],
        running=stats["running"], waiting=stats["waiting"], preemptions=stats["preemptions"],
        graph_replays=stats.get("graph_replays", 0), compiled_steps=stats.get("compiled_steps", 0),
        eager_steps=stats.get("eager_steps", sum(steps.values())), kernel_compiles=stats.get("kernel_compiles", 0),
        spec_draft_tokens=stats.get("spec_draft_tokens", 0), spec_accepted_tokens=stats.get("spec_accepted_tokens", 0),
        kv_pages_cached=stats["kv_pages_cached"], prefix_cache_query_tokens=stats["prefix_cache_query_tokens"],
        prefix_cache_hit_tokens=stats["prefix_cache_hit_tokens"], overlapped_steps=stats["overlapped_steps"],
        step_seconds=stats["step_seconds"],
    )


class EngineLoop:
    def __init__(self, engine: Engine, inbox: MessageReader, outbox: MessageWriter) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.unscheduled: dict[str, float] = {}  # request id -> arrival, until first scheduled
        self.queue_times: dict[str, float] = {}  # measured, until sent with the request's next delta
        self._stats_sent = -math.inf  # time.monotonic() of the last StepResult with stats

    def run(self) -> None:
        while self._take_commands(block=not self.engine.has_unfinished_requests()):
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed")
                outputs = self._abort_all(f"{type(exc).__name__}: {exc}")
            self._note_scheduled()
            self.outbox.send(StepResult([self._delta_row(o) for o in outputs], self._stats_due()))

    def _stats_due(self) -> EngineStats | None:
        """The engine's stats if a step's result should carry them (``STATS_INTERVAL_S``), else None:
        the server keeps the last ones it got, exact whenever the engine is idle."""
        now = time.monotonic()
        if self.engine.has_unfinished_requests() and now - self._stats_sent < STATS_INTERVAL_S:
            return None
        self._stats_sent = now
        return engine_stats(self.engine)

    def _take_commands(self, block: bool) -> bool:
        """Applies the commands that have arrived, first waiting for one if ``block``. False on
        Shutdown, or once the server process is gone (nobody would read the outputs)."""
        if block:
            self._wait_for_commands()
        for command in self.inbox.read():
            if isinstance(command, Shutdown):
                return False
            self._apply(command)
        return not self.inbox.eof

    def _wait_for_commands(self) -> None:
        """Sleeps until the command pipe is readable (a command, or the server gone), writing the
        outputs the output pipe could not take yet as it takes them."""
        while True:
            writes = [self.outbox] if self.outbox.pending else []
            readable, writable, _ = select.select([self.inbox], writes, [])
            if writable:
                self.outbox.flush()
            if readable:
                return

    def _apply(self, command: Submit | Abort) -> None:
        if isinstance(command, Abort):
            self.engine.abort(command.request_id)
            self.unscheduled.pop(command.request_id, None)
            self.queue_times.pop(command.request_id, None)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except ValueError as exc:
            self.outbox.send(Rejected(command.request_id, str(exc)))
            return
        self.unscheduled[command.request_id] = command.arrival

    def _abort_all(self, message: str) -> list[RequestOutput]:
        """After a failed step: aborts every request (its state may be half-updated) and flushes the
        aborts, which frees their pages. If even that fails the engine cannot recover: it raises."""
        request_ids = list(self.engine.requests)
        for request_id in request_ids:
            self.engine.abort(request_id)
        self.outbox.send(StepFailed(request_ids, message))
        return self.engine.step()

    def _note_scheduled(self) -> None:
        """Measures queue time: a request leaves the queue at the first step that schedules it."""
        now = time.monotonic()
        for request_id, arrival in list(self.unscheduled.items()):
            req = self.engine.requests.get(request_id)
            if req is None or req.status is not RequestStatus.WAITING:
                self.queue_times[request_id] = now - arrival
                del self.unscheduled[request_id]

    def _delta_row(self, out: RequestOutput) -> tuple:
        """The request's ``Delta``, as the plain tuple a ``StepResult`` carries (messages module)."""
        n = len(out.new_token_ids)
        return (
            out.request_id,
            out.new_token_ids,  # pickled at once by the send: no copy needed
            out.logprobs[len(out.logprobs) - n:] if out.logprobs is not None else None,
            out.finish_reason if out.finished else None,
            self.queue_times.pop(out.request_id, None) if self.queue_times else None,
            out.num_accepted_tokens,
            out.num_cached_tokens,
        )
