"""Starts the engine process, first thing: ``encore serve`` spawns it before it imports the server (torch,
Dynamo, gRPC, xgrammar, the tokenizer), so that the engine process's own imports and model loading run
while the server imports, loads its tokenizer and starts listening, not after.

This module imports no torch, and neither do ``encore.server.cli`` and the modules it imports at its
top (``test_engine_spawn.py`` checks): a spawned process imports its parent's main module again, and
the server's imports would otherwise come first. Before its own imports the engine process starts
reading the checkpoint into the page cache (``models/shards.py``), so that a checkpoint not yet there
comes off the disk during them. The process runs ``engine_worker.run_engine``, with
the "spawn" context (a fresh interpreter: no forked CUDA or gRPC state); ``EngineProcess`` takes over
its pipes.

The engine process dies with the server process, however the server ends: on Linux the kernel kills
it (``PR_SET_PDEATHSIG``), so that no engine outlives its server holding GPU memory, e.g. after a
SIGTERM that came before the server had set its handlers. The kernel signals when the thread that
spawned the engine ends, so call ``spawn_engine`` from a thread that lives as long as the server.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import NamedTuple

from encore.models.shards import prefetch_in_background

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class SpawnedEngine(NamedTuple):
    process: BaseProcess
    commands: Connection  # the server's end: commands go out
    outputs: Connection  # the server's end: outputs come in


def spawn_engine(engine_kwargs: dict, engine_factory: Callable | None = None) -> SpawnedEngine:
    """Starts the engine process building ``engine_factory(**engine_kwargs, ...)`` (``Engine`` if None)."""
    ctx = multiprocessing.get_context("spawn")
    command_end, commands = ctx.Pipe(duplex=False)
    outputs, output_end = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_engine_main,
                          args=(os.getpid(), engine_kwargs, command_end, output_end, engine_factory),
                          name="encore-engine", daemon=True)
    process.start()
    for end in (command_end, output_end):  # the process has its copies; else the pipes would not report its end
        end.close()
    return SpawnedEngine(process, commands, outputs)


def _engine_main(server_pid: int, engine_kwargs: dict, commands: Connection, outputs: Connection,
                 engine_factory: Callable | None) -> None:
    # Ctrl-C reaches the whole process group; the server stops the engine itself (EngineProcess.stop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:  # the server was gone before the kernel could be told
        os._exit(1)
    prefetch_in_background(engine_kwargs.get("model"))  # the disk read overlaps the imports below
    from encore.engine import Engine  # in the engine process only: torch and the engine
    from encore.server.engine_worker import run_engine

    run_engine(engine_kwargs, commands, outputs, engine_factory or Engine)
