"""Fixtures for the gRPC tests: the shared server, a client of it, and the in-process reference engine."""

from __future__ import annotations

import pytest
from server_harness import API_KEY, ServerThread, engine_kwargs

from encore.engine import Engine
from encore.server.client import Client
from encore.server.config import ServerConfig


@pytest.fixture(scope="session")
def server(v3_dir):
    """The shared server: API key required, 1 MiB messages; its engine overlaps its steps, as on CUDA,
    where the in-process reference does not."""
    config = ServerConfig(port=0, api_key=API_KEY, max_message_bytes=1 << 20, metrics_port=0)
    handle = ServerThread(config, engine_kwargs(v3_dir, overlap_schedule=True)).listen()
    handle.start_engine()
    yield handle
    handle.stop()


@pytest.fixture
def client(server):
    with Client(server.target, api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="session")
def reference(v3_dir):
    """The in-process Engine the streams are compared with."""
    return Engine(**engine_kwargs(v3_dir))
