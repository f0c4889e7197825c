"""``encore serve`` spawns the engine process before it imports torch (engine_spawn.py), the server
process never imports the engine, and a server stopped while its engine is still starting stops it at
once."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest
from faulty_engine import StuckEngine
from server_harness import ServerThread, engine_kwargs

from encore.server.config import ServerConfig
from encore.server.engine_process import EngineStartError

# Runs `encore serve` up to the engine's spawn, which reports whether torch was imported by then.
SPY = r"""
import sys
import encore.server.cli as cli

def spawn_engine(kwargs, engine_factory=None):
    sys.exit(3 if "torch" in sys.modules else 0)

cli.spawn_engine = spawn_engine
cli.main(["serve", "--port", "0"])
"""


def test_serve_spawns_the_engine_before_it_imports_torch():
    child = subprocess.run([sys.executable, "-c", SPY], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])


def test_the_server_process_imports_neither_the_engine_nor_dynamo():
    code = ("import sys, encore.server.server; "
            "sys.exit(sorted({'encore.engine.engine', 'torch._dynamo'} & set(sys.modules)) or None)")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]


def test_a_server_stopped_while_its_engine_starts_kills_it_at_once(v3_dir, caplog):
    handle = ServerThread(ServerConfig(port=0), engine_kwargs(v3_dir), StuckEngine).listen()
    process = handle.server.engine._process
    waiting = asyncio.run_coroutine_threadsafe(handle.server.start_engine(), handle.loop)
    with caplog.at_level(logging.WARNING):
        handle.stop()
    with pytest.raises(EngineStartError, match="died"):
        waiting.result(10)
    assert not process.is_alive()
    assert "did not stop" not in caplog.text
