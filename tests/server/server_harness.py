"""Helpers for the gRPC tests: an EncoreServer on its own event loop in a background thread, with
its engine in a spawned process, and polling helpers. (A module of its own rather than conftest,
whose name other test folders share.)"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from encore.server.client import Client
from encore.server.config import ServerConfig
from encore.server.engine_spawn import spawn_engine
from encore.server.server import EncoreServer

API_KEY = "test-key"
MAX_MODEL_LEN = 256


def engine_kwargs(model_dir, **overrides) -> dict:
    """One engine configuration for the servers and the in-process references."""
    return {"model": str(model_dir), "device": "cpu", "dtype": "float32", "page_size": 16, "num_kv_pages": 1024,
            "max_num_seqs": 64, "max_model_len": MAX_MODEL_LEN} | overrides


class ServerThread:
    """Runs an EncoreServer on an event loop in a daemon thread; ``call`` runs a coroutine there."""

    def __init__(self, config: ServerConfig, kwargs: dict, engine_factory=None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        self.server = EncoreServer(config, kwargs, spawn_engine(kwargs, engine_factory))
        self.progress: list[tuple[str, float]] = []  # the engine's progress lines, with when it wrote each

    def call(self, coroutine, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def listen(self) -> ServerThread:
        self.call(self.server.start())
        return self

    def start_engine(self) -> None:
        self.call(self.server.start_engine(lambda line, at: self.progress.append((line, at))))

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05):
    """Polls ``predicate`` until it returns something truthy; returns it, or fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


def wait_idle(client: Client, timeout: float = 20.0):
    """Waits until nothing is in flight and every KV page is free; returns the ServerInfo."""
    def idle():
        info = client.server_info()
        done = (info.in_flight_requests == 0 and info.running_requests == 0 and info.waiting_requests == 0
                and info.kv_cache.pages_free == info.kv_cache.pages_total)
        return info if done else None

    return wait_until(idle, timeout)


def status_of(call) -> grpc.StatusCode:
    """Drains a streaming call; the status it ended with."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
