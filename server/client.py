"""Python clients for encore's gRPC service: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

>>> with Client("127.0.0.1:50051") as client:
...     print(client.generate("def fib(n):", max_tokens=32, temperature=0.0).text)
...     for chunk in client.stream("def fib(n):", max_tokens=32):
...         print(chunk.text, end="", flush=True)

``stream`` returns the gRPC call itself: iterate it for the response deltas, ``cancel()`` it to
abort the request (the server frees its pages). A ``timeout`` becomes the call's deadline.
"""

from __future__ import annotations

import contextlib
import reprlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encore.protos.encore.v1 import generate_pb2 as pb
from encore.protos.encore.v1 import generate_pb2_grpc as pb_grpc

_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def build_request(prompt: str | Sequence[int], *, request_id: str = "", max_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  min_p: float | None = None, repetition_penalty: float | None = None,
                  presence_penalty: float | None = None, frequency_penalty: float | None = None,
                  seed: int | None = None, stop: str | Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, min_tokens: int | None = None, logprobs: int | None = None,
                  speculative: bool | None = None) -> pb.GenerateRequest:
    """A GenerateRequest; options left None are left unset, so the server's defaults apply
    (``speculative=False`` opts the request out of the server's speculative decoding). ``stop`` is one
    stop string or several. A value the message cannot hold (a negative count, a string for a number)
    raises ValueError naming the option; the server checks the ranges of the rest."""
    request = pb.GenerateRequest(request_id=request_id)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        with _naming("prompt", prompt):
            request.token_ids.ids.extend(prompt)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
                "frequency_penalty": frequency_penalty, "seed": seed}
    stopping = {"max_tokens": max_tokens, "ignore_eos": ignore_eos, "min_tokens": min_tokens}
    top = {"logprobs": logprobs, "speculative": speculative}
    for message, options in ((request.sampling, sampling), (request.stopping, stopping), (request, top)):
        for name, value in options.items():
            if value is not None:
                with _naming(name, value):
                    setattr(message, name, value)
    stop = [stop] if isinstance(stop, str) else stop
    with _naming("stop", stop):
        request.stopping.stop.extend(stop)
    with _naming("stop_token_ids", stop_token_ids):
        request.stopping.stop_token_ids.extend(stop_token_ids)
    return request


@contextlib.contextmanager
def _naming(option: str, value: object) -> Iterator[None]:
    """Protobuf's type and range errors inside, raised as a ValueError that names the option."""
    try:
        yield
    except (TypeError, ValueError) as err:
        raise ValueError(f"{option}={reprlib.repr(value)}: {err}") from None


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    usage: pb.Usage
    logprobs: list[pb.TokenLogprob]


class _Collector:
    """Joins a stream's deltas into a Completion."""

    def __init__(self) -> None:
        self.request_id, self.token_ids, self.text, self.logprobs = "", [], [], []
        self.finish_reason, self.usage = "", pb.Usage()

    def add(self, response: pb.GenerateResponse) -> None:
        self.request_id = response.request_id
        self.token_ids.extend(response.token_ids)
        self.text.append(response.text)
        self.logprobs.extend(response.logprobs)
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = _FINISH_REASONS[response.finish_reason]
            self.usage = response.usage

    def completion(self) -> Completion:
        return Completion(self.request_id, self.token_ids, "".join(self.text), self.finish_reason, self.usage,
                          self.logprobs)


def collect(responses: Iterable[pb.GenerateResponse]) -> Completion:
    collector = _Collector()
    for response in responses:
        collector.add(response)
    return collector.completion()


def _channel(target: str, tls: bool, root_certificates: bytes | None, max_message_bytes: int,
             aio: bool) -> grpc.Channel | grpc.aio.Channel:
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes)]
    module = grpc.aio if aio else grpc
    if tls or root_certificates is not None:
        return module.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=options)
    return module.insecure_channel(target, options=options)


class Client:
    """Blocking client. ``tls`` (or ``root_certificates``, PEM bytes) for a TLS server;
    ``api_key`` for one started with --api-key."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, max_message_bytes: int = 4 << 20) -> None:
        self.channel = _channel(target, tls, root_certificates, max_message_bytes, aio=False)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
               **options) -> Iterator[pb.GenerateResponse]:
        """The response deltas (the call: ``cancel()`` aborts). ``options``: see build_request."""
        return self.stub.Generate(build_request(prompt, **options), timeout=timeout, metadata=self.metadata)

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, **options) -> Completion:
        return collect(self.stream(prompt, timeout=timeout, **options))

    def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self.metadata)

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout, metadata=self.metadata)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """"SERVING", "NOT_SERVING", ... as the standard health service reports it."""
        reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncClient:
    """asyncio client; the same methods as Client, awaited (``stream`` is iterated with ``async for``)."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, max_message_bytes: int = 4 << 20) -> None:
        self.channel = _channel(target, tls, root_certificates, max_message_bytes, aio=True)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
               **options) -> grpc.aio.UnaryStreamCall:
        return self.stub.Generate(build_request(prompt, **options), timeout=timeout, metadata=self.metadata)

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, **options) -> Completion:
        collector = _Collector()
        async for response in self.stream(prompt, timeout=timeout, **options):
            collector.add(response)
        return collector.completion()

    async def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self.metadata)

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    async def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout, metadata=self.metadata)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        reply = await health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
