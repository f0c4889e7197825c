"""The server's handle on the engine process (started by ``engine_spawn``): waits for its warm-up,
sends it commands, routes its outputs.

Commands and outputs travel over two pipes (``message_pipe``), both served by the event
loop itself: a command is written as it is sent, or later when the pipe can take it
(``loop.add_writer``); the output pipe is read when readable (``loop.add_reader``) and each message
is routed to the ``RequestStream`` it belongs to — one wake-up per engine step, not per token, and
no thread between the pipe and the loop. The process's sentinel is watched the same way: when it
exits, every stream in flight fails with INTERNAL and ``failure`` says why, so the server can
report NOT_SERVING.

Each submission gets an engine request id of its own (``"<n>:<request_id>"``): a client may reuse
its request_id as soon as its stream has ended, while the engine may not yet have processed the
abort of the previous request of that name.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import grpc

from encore.engine import SamplingParams
from encore.server.engine_spawn import SpawnedEngine
from encore.server.message_pipe import MessageReader, MessageWriter
from encore.server.messages import (
    Abort, EngineInfo, EngineStats, Fatal, Progress, Ready, Rejected, Shutdown, StepFailed, StepResult, Submit,
)
from encore.server.request_stream import RequestStream

log = logging.getLogger(__name__)

_JOIN_S = 10.0


class EngineStartError(RuntimeError):
    pass


class EngineProcess:
    def __init__(self, spawned: SpawnedEngine) -> None:
        self._process = spawned.process
        self._commands = MessageWriter(spawned.commands)
        self._outputs = MessageReader(spawned.outputs)
        self.streams: dict[str, RequestStream] = {}  # in flight, by the client's request id
        self._routes: dict[str, RequestStream] = {}  # the same, by engine request id
        self._submissions = itertools.count()
        self.info: EngineInfo | None = None
        self.stats: EngineStats | None = None
        self.failure: str | None = None  # set once the process is gone
        self._fatal: str | None = None
        self._stopping = False
        self._on_progress: Callable[[str, float], None] = lambda message, at: None
        self._on_death: Callable[[str], None] = lambda failure: None
        self._started: asyncio.Future[EngineInfo] | None = None
        self._exited: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ready(self) -> bool:
        return self.info is not None and self.failure is None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    async def start(self, on_progress: Callable[[str, float], None] = lambda message, at: None,
                    on_death: Callable[[str], None] = lambda failure: None) -> EngineInfo:
        """Waits until the process has warmed up, passing its progress lines to ``on_progress(line, at)``
        (``at``: when the process wrote the line, ``messages.Progress``). ``on_death`` is called (on the
        event loop) if it dies later. Raises EngineStartError if it cannot start."""
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._exited = asyncio.Event()
        self._on_progress, self._on_death = on_progress, on_death
        self._loop.add_reader(self._outputs.fileno(), self._read)
        self._loop.add_reader(self._process.sentinel, self._exit)
        return await self._started

    def submit(self, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams) -> None:
        stream.engine_id = f"{next(self._submissions)}:{stream.request_id}"
        self.streams[stream.request_id] = self._routes[stream.engine_id] = stream
        self._send(Submit(stream.engine_id, prompt_token_ids, params, stream.arrival))

    def abort(self, stream: RequestStream) -> None:
        """Aborts in the engine; the stream ends with finish reason "abort" when the engine says so."""
        if self.failure is None:
            self._send(Abort(stream.engine_id))

    def cancel(self, stream: RequestStream) -> None:
        """The client is gone: forget the stream now and abort in the engine, freeing its pages."""
        self._forget(stream)
        self.abort(stream)

    def _forget(self, stream: RequestStream) -> None:
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]
        self._routes.pop(stream.engine_id, None)

    async def stop(self) -> None:
        """Lets a serving engine finish its step and exit. One still starting is killed at once: it reads
        no command before it is ready, and has nothing in flight."""
        self._stopping = True
        if self._exited is None:  # never waited on
            self._process.kill()
            self._process.join()
            return
        if self._exited.is_set():
            return
        if self.info is None:
            self._process.kill()
            await self._exited.wait()
            return
        self._send(Shutdown())
        try:
            await asyncio.wait_for(self._exited.wait(), _JOIN_S)
        except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11 on
            log.warning("engine process %s did not stop in %.0f s; killing it", self._process.pid, _JOIN_S)
            self._process.kill()
            await self._exited.wait()

    # ---- on the event loop -----------------------------------------------------------------

    def _send(self, command: Submit | Abort | Shutdown) -> None:
        backlogged = self._commands.pending  # the writer is registered already
        if not self._commands.send(command) and not backlogged:
            self._loop.add_writer(self._commands.fileno(), self._flush_commands)

    def _flush_commands(self) -> None:
        if self._commands.flush():
            self._loop.remove_writer(self._commands.fileno())

    def _read(self) -> None:
        for message in self._outputs.read():
            self._handle(message)
        if self._outputs.eof:
            self._loop.remove_reader(self._outputs.fileno())

    def _exit(self) -> None:
        """The process has exited: reads what it wrote last, then reports its death."""
        self._loop.remove_reader(self._process.sentinel)
        self._loop.remove_writer(self._commands.fileno())
        self._read()
        self._loop.remove_reader(self._outputs.fileno())
        self._process.join()  # at once: it has exited
        self._died(self._process.exitcode)
        self._exited.set()

    def _handle(self, message) -> None:
        if isinstance(message, StepResult):
            if message.stats is not None:
                self.stats = message.stats
            for delta in message.deltas:
                stream = self._routes.get(delta.request_id)
                if stream is None:
                    continue  # cancelled by its client, or stopped early by a stop string
                stream.feed(delta)
                if delta.finish_reason is not None:
                    self._forget(stream)
        elif isinstance(message, Rejected):
            self._fail(message.request_id, grpc.StatusCode.INVALID_ARGUMENT, message.message)
        elif isinstance(message, StepFailed):
            for engine_id in message.request_ids:
                self._fail(engine_id, grpc.StatusCode.INTERNAL,
                           f"the engine failed while running this request ({message.message}); "
                           f"it was aborted and the server goes on serving")
        elif isinstance(message, Progress):
            self._on_progress(message.message, message.at)
        elif isinstance(message, Ready):
            self.info, self.stats = message.info, message.stats
            if not self._started.done():  # done: start() was cancelled (shutdown during warm-up)
                self._started.set_result(message.info)
        elif isinstance(message, Fatal):
            self._fatal = message.message

    def _fail(self, engine_id: str, code: grpc.StatusCode, message: str) -> None:
        stream = self._routes.get(engine_id)
        if stream is not None:
            self._forget(stream)
            stream.fail(code, message)

    def _died(self, exitcode: int | None) -> None:
        self.failure = f"the engine process died (exit code {exitcode})"
        if self._fatal:
            self.failure += f": {self._fatal}"
        if not self._started.done():
            self._started.set_exception(EngineStartError(self.failure))
            return
        if self._stopping:
            return
        log.error("%s; the server is NOT_SERVING", self.failure)
        for engine_id in list(self._routes):
            self._fail(engine_id, grpc.StatusCode.INTERNAL, f"{self.failure}; the server is NOT_SERVING")
        self._on_death(self.failure)
