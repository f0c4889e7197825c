"""The gRPC server: generation service, health, reflection, API key, TLS, message limits, metrics.

``start()`` listens at once with health NOT_SERVING, so probes and clients get an answer while the
engine loads; ``start_engine()`` waits for the engine process (spawned before the server was built,
engine_spawn.py) to warm up and turns health to SERVING. If the engine process dies later, health
goes back to NOT_SERVING and the server keeps answering: in-flight calls fail with INTERNAL, new ones
get UNAVAILABLE, both saying it died; info and health calls still work so operators can see why.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from encore.engine.tokenizer import load_tokenizer
from encore.server.auth import ApiKeyInterceptor
from encore.server.config import ServerConfig
from encore.server.engine_process import EngineProcess
from encore.server.engine_spawn import SpawnedEngine
from encore.server.messages import EngineInfo
from encore.server.metrics import ServerMetrics, start_metrics_server
from encore.server.servicer import SERVICE_NAME, GenerationServicer, method_handlers

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EncoreServer:
    def __init__(self, config: ServerConfig, engine_kwargs: dict, engine: SpawnedEngine) -> None:
        """``engine``: the process ``spawn_engine(engine_kwargs, ...)`` started."""
        self.config = config
        self.engine = EngineProcess(engine)
        self.tokenizer = load_tokenizer(Path(engine_kwargs["model"]))
        self.metrics = ServerMetrics()
        self.servicer = GenerationServicer(config, self.engine, self.tokenizer, self.metrics)
        self.health = health.aio.HealthServicer()
        self.port: int | None = None  # bound, once listening
        self.metrics_port: int | None = None
        self._grpc: list[grpc.aio.Server] = []
        self._listener_calls = [_CallCounter() for _ in range(config.listeners)]
        self._metrics_server: asyncio.Server | None = None
        self._background: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return _address(self.config.host, self.port)

    async def start(self) -> None:
        """Listens (health NOT_SERVING until ``start_engine`` has finished)."""
        cfg = self.config
        shared = cfg.listeners > 1
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            # gRPC sets SO_REUSEPORT by default on Linux; where only one listener binds, that would let a
            # second server share the port silently (with several, _claim_port checks the port first).
            ("grpc.so_reuseport", int(shared)),
        ]
        interceptors = [ApiKeyInterceptor(cfg.api_key)] if cfg.api_key else []
        credentials = None
        if cfg.tls:
            credentials = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(),
                                                        Path(cfg.tls_cert).read_bytes())])
        address = _address(cfg.host, _claim_port(cfg.host, cfg.port) if shared else cfg.port)
        await self._set_health(NOT_SERVING)
        servers = []
        for counter in self._listener_calls:
            server = grpc.aio.server(interceptors=interceptors, options=options)
            server.add_generic_rpc_handlers((counter, method_handlers(self.servicer)))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                server)
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
            if not port:
                raise RuntimeError(f"could not listen on {address}")
            servers.append(server)
        self.port = self.servicer.port = port
        for server in servers:
            await server.start()
        self._grpc = servers
        if cfg.metrics_port is not None:
            self._metrics_server = await start_metrics_server(cfg.host, cfg.metrics_port, self.render_metrics)
            self.metrics_port = self._metrics_server.sockets[0].getsockname()[1]

    async def start_engine(self, on_progress: Callable[[str, float], None] = lambda message, at: None) -> EngineInfo:
        """Waits for the engine process's warm-up, then reports SERVING.
        Raises EngineStartError if it cannot start."""
        info = await self.engine.start(on_progress, on_death=self._engine_died)
        await self._set_health(SERVING)
        return info

    async def stop(self) -> None:
        """NOT_SERVING, then lets running streams finish for the grace period, then stops the engine."""
        await self._set_health(NOT_SERVING)
        await asyncio.gather(*(server.stop(self.config.shutdown_grace_s) for server in self._grpc))
        if self._metrics_server is not None:
            self._metrics_server.close()
            await self._metrics_server.wait_closed()
        await self.engine.stop()
        self.servicer.close()

    async def wait_for_termination(self) -> None:
        await asyncio.gather(*(server.wait_for_termination() for server in self._grpc))

    def render_metrics(self) -> str:
        return self.metrics.render(self.engine.stats, len(self.engine.streams), self.engine.ready,
                                   [counter.calls for counter in self._listener_calls])

    def _engine_died(self, failure: str) -> None:
        task = asyncio.get_running_loop().create_task(self._set_health(NOT_SERVING))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)


class _CallCounter(grpc.GenericRpcHandler):
    """Counts the calls one listener takes in (those its registered health and reflection methods answer
    aside), then leaves them to the next handler."""

    def __init__(self) -> None:
        self.calls = 0

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> None:
        self.calls += 1


def _claim_port(host: str, port: int) -> int:
    """``port``, or a free port where it is 0, after checking that no socket holds it at ``host``: the
    listeners bind with SO_REUSEPORT, which would otherwise share it with another server bound that way,
    silently. Raises RuntimeError naming the address if it is taken or cannot be bound."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RuntimeError(f"could not listen on {_address(host, port)}: {exc}") from exc
    probes = []
    try:
        for family, kind, proto, _, address in infos:
            probe = socket.socket(family, kind, proto)
            probes.append(probe)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: past TIME_WAIT
            probe.bind((address[0], port, *address[2:]))
            port = probe.getsockname()[1]
    except OSError as exc:
        raise RuntimeError(f"could not listen on {_address(host, port)}: {exc.strerror}") from exc
    finally:
        for probe in probes:
            probe.close()
    return port


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
