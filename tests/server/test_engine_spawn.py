"""``encore serve`` spawns the engine process before it imports torch (engine_spawn.py), the server
process never imports the engine, the engine's progress lines carry when it wrote them, a server
stopped while its engine is still starting stops it at once, and an engine dies with its server."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path

import pytest
from faulty_engine import StuckEngine
from server_harness import ServerThread, engine_kwargs, wait_until

from encore.server.config import ServerConfig
from encore.server.engine_process import EngineStartError
from encore.server.engine_spawn import spawn_engine
from encore.server.server import EncoreServer

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


# A server built (its tokenizer loaded), started and stopped, which then reports what of the engine it imported.
SERVER = r"""
import asyncio, sys
from encore.server.config import ServerConfig
from encore.server.engine_spawn import spawn_engine
from encore.server.server import EncoreServer

async def main():
    kwargs = {"model": sys.argv[1], "device": "cpu"}
    server = EncoreServer(ServerConfig(port=0), kwargs, spawn_engine(kwargs))
    await server.start()
    await server.stop()

asyncio.run(main())
sys.exit(sorted({"encore.engine.engine", "torch._dynamo"} & set(sys.modules)) or None)
"""

# Spawns a stuck engine and, once the engine has sent its first message (it is building the engine then,
# and would write nothing more to the pipe, whose breaking would end it), says its pid and waits to be killed.
PARENT = r"""
import sys, time
from multiprocessing.connection import wait
sys.path.insert(0, sys.argv[2])
from faulty_engine import StuckEngine
from encore.server.engine_spawn import spawn_engine

engine = spawn_engine({"model": sys.argv[1], "device": "cpu"}, StuckEngine)
assert wait([engine.outputs], timeout=120)
print(engine.process.pid, flush=True)
time.sleep(600)
"""


def test_the_server_process_imports_neither_the_engine_nor_dynamo(v3_dir):
    child = subprocess.run([sys.executable, "-c", SERVER, str(v3_dir)], capture_output=True, text=True, timeout=180)
    assert child.returncode == 0, child.stderr[-3000:]


def test_progress_lines_carry_when_the_engine_wrote_them(v3_dir):
    """The server reads the engine's lines only once it waits for the engine (encore serve: once it
    listens), so each line carries its own time; here the first is read over a second after it was written."""
    kwargs = engine_kwargs(v3_dir)
    spawned = spawn_engine(kwargs)
    assert wait([spawned.outputs], timeout=120)  # the first line is written, and not yet read
    time.sleep(1.0)
    lines = []

    async def start() -> float:
        server = EncoreServer(ServerConfig(port=0), kwargs, spawned)
        reading_from = time.monotonic()
        try:
            await server.start_engine(lambda line, at: lines.append((line, at)))
        finally:
            await server.stop()
        return reading_from

    reading_from = asyncio.run(start())
    assert lines[0][0].startswith("loading") and lines[0][1] <= reading_from - 1.0
    stamps = [at for _, at in lines]
    assert stamps == sorted(stamps)


def _alive(pid: int) -> bool:
    """Running, not a zombie: a container's first process need not reap the orphans it inherits."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel kills the engine with its server on Linux")
def test_an_engine_dies_with_its_server_however_the_server_ends(v3_dir):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(v3_dir), str(Path(__file__).parent)],
                              stdout=subprocess.PIPE, text=True)
    try:
        engine = int(parent.stdout.readline())
        assert _alive(engine)
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: not _alive(engine))


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
