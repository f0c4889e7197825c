"""ServerConfig: how the gRPC front end listens and what it admits, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_MIN_MESSAGE_BYTES = 1024
_MAX_LISTENERS = 256


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """
    ``host``/``port``: where gRPC listens (localhost unless told otherwise; port 0 picks a free one).
    ``tls_cert``/``tls_key``: PEM files; both or neither (plaintext).
    ``api_key``: when set, every call but health and reflection must send
    ``authorization: Bearer <api_key>``.
    ``max_queued_requests``: requests admitted beyond the engine's ``max_num_seqs`` running slots;
    one more gets RESOURCE_EXHAUSTED.
    ``max_message_bytes``: the largest request or response message gRPC accepts.
    ``metrics_port``: serve Prometheus metrics over HTTP on ``host:metrics_port`` (None: off).
    ``shutdown_grace_s``: how long running streams may finish when the server stops.
    ``listeners``: gRPC servers on the one port (SO_REUSEPORT; the kernel deals each client connection to
    one of them), all on the one event loop. A grpc.aio server takes in its calls one at a time, each
    after a round of the loop, which streaming keeps busy; several take a burst of calls from several
    connections in parallel (the calls of one connection all reach the same one). The kernel picks a
    connection's listener by a hash of its addresses, so connections collide: 8 connections on localhost
    met 2-4 on the busiest of 8 listeners (6 tries), 1-2 of 64. More listeners took a burst in fewer
    waves on an H200 host, but served it no faster (benchmarks/README.md, session 21), so the default
    stays 8.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    tls_cert: str | None = None
    tls_key: str | None = None
    api_key: str | None = None
    max_queued_requests: int = 1024
    max_message_bytes: int = 4 << 20
    metrics_port: int | None = None
    shutdown_grace_s: float = 5.0
    listeners: int = 8

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must be a non-empty address, e.g. '127.0.0.1' or '0.0.0.0'")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= 65535):
                raise ValueError(f"{name} must be an integer in [0, 65535], got {value!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"TLS needs both tls_cert and tls_key, got tls_cert={self.tls_cert!r}, "
                             f"tls_key={self.tls_key!r}")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} {path!r} is not a file")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string when set")
        if not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be an integer >= 0, got {self.max_queued_requests!r}")
        if not isinstance(self.max_message_bytes, int) or self.max_message_bytes < _MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be an integer >= {_MIN_MESSAGE_BYTES}, "
                             f"got {self.max_message_bytes!r}")
        if not isinstance(self.listeners, int) or not 1 <= self.listeners <= _MAX_LISTENERS:
            raise ValueError(f"listeners must be an integer in [1, {_MAX_LISTENERS}], got {self.listeners!r}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s!r}")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def public_items(self) -> dict[str, str]:
        """The settings as strings for GetServerInfo: the API key's presence, never its value."""
        return {
            "host": self.host,
            "port": str(self.port),
            "tls": str(self.tls).lower(),
            "api_key": "set" if self.api_key else "unset",
            "max_queued_requests": str(self.max_queued_requests),
            "max_message_bytes": str(self.max_message_bytes),
            "metrics_port": "off" if self.metrics_port is None else str(self.metrics_port),
            "listeners": str(self.listeners),
        }
