"""The encore.v1.GenerationService handlers.

A Generate call is validated (RequestParser), admitted against the queue limit, handed to the
engine process, then streamed from its RequestStream. Whatever ends the call early — the client
cancels, disconnects or passes its deadline, all of which cancel this handler — the ``finally``
aborts the request in the engine, which frees its KV pages at its next step.

Requests are decoded leniently: bytes that are not a valid message reach the handler as
``MalformedMessage`` and get INVALID_ARGUMENT, where gRPC's own decoding failure would report
INTERNAL, a server fault.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from encore.engine import SamplingParams
from encore.protos.encore.v1 import generate_pb2 as pb
from encore.server.config import ServerConfig
from encore.server.engine_process import EngineProcess
from encore.server.metrics import ServerMetrics
from encore.server.request_parser import RequestError, RequestParser, check_request_id
from encore.server.request_stream import RequestStream, SendPacer, StreamError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
VERSION = importlib.metadata.version("encore")
# Messages built and sent per round of the event loop (request_stream.SendPacer). A call is taken in
# over ~3 rounds, each behind that round's sends: 1 took a 64-call burst in about half the time 4 did
# (benchmarks/README.md, session 21).
SENDS_PER_ROUND = 1


@dataclass(frozen=True, slots=True)
class MalformedMessage:
    error: str


class GenerationServicer:
    def __init__(self, config: ServerConfig, engine: EngineProcess, tokenizer, metrics: ServerMetrics) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.port = config.port  # the bound one, once listening
        self.started_at = time.monotonic()
        self._parser: RequestParser | None = None
        self._pacer = SendPacer(SENDS_PER_ROUND)

    @property
    def max_in_flight(self) -> int:
        return self.engine.info.max_num_seqs + self.config.max_queued_requests

    def close(self) -> None:
        if self._parser is not None:
            self._parser.close()

    async def Generate(self, request: pb.GenerateRequest | MalformedMessage,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        await self._check_message(request, context)
        await self._check_ready(context)
        try:
            parsed = await self._request_parser().parse(request)
        except RequestError as exc:
            await self._reject(context, exc.code, exc.message)
        await self._check_ready(context)  # again: the engine may have died while the prompt was parsed
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.engine.streams:
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {request_id!r} is already running; pick another or leave it empty")
        if len(self.engine.streams) >= self.max_in_flight:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the queue is full: {len(self.engine.streams)} requests in flight, the limit is "
                               f"{self.max_in_flight} (max_num_seqs + max_queued_requests); retry later")
        info = self.engine.info
        stream = RequestStream(request_id, parsed.prompt_token_ids, parsed.params.stop, self.tokenizer,
                               frozenset(info.eos_token_ids), arrival=time.monotonic(), pacer=self._pacer,
                               min_tokens=parsed.params.min_tokens)
        # The engine process has no tokenizer: the stop strings are matched here (see request_stream).
        self.engine.submit(stream, parsed.prompt_token_ids, _without_stop_strings(parsed.params))
        try:
            while True:
                await stream.next_turn()
                response = stream.take_response()
                if response is None:
                    break
                if stream.stopped_early:  # free the request id before the client sees the end
                    self.engine.cancel(stream)
                yield response
        except StreamError as exc:
            await context.abort(exc.code, exc.message)
        finally:
            if not stream.finished:
                self.engine.cancel(stream)
            self.metrics.observe_stream(stream)

    async def Abort(self, request: pb.AbortRequest | MalformedMessage,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._check_message(request, context)
        try:
            check_request_id(request.request_id)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        stream = self.engine.streams.get(request.request_id)
        if stream is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running request has request_id {request.request_id!r}")
        self.engine.abort(stream)
        return pb.AbortResponse()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest | MalformedMessage,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._check_message(request, context)
        await self._check_ready(context)
        info = self.engine.info
        return pb.ModelInfo(
            model=info.model, architecture=info.architecture, vocab_size=info.vocab_size,
            max_model_len=info.max_model_len, num_hidden_layers=info.num_hidden_layers, hidden_size=info.hidden_size,
            num_attention_heads=info.num_attention_heads, kv_lora_rank=info.kv_lora_rank,
            qk_rope_head_dim=info.qk_rope_head_dim, eos_token_ids=info.eos_token_ids,
            has_tokenizer=self.tokenizer is not None, supports_structured_output=self.tokenizer is not None,
            supports_speculative=info.speculative_method is not None,
        )

    async def GetServerInfo(self, request: pb.GetServerInfoRequest | MalformedMessage,
                            context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        await self._check_message(request, context)
        engine = self.engine
        reply = pb.ServerInfo(
            version=VERSION, engine_alive=engine.failure is None, ready=engine.ready,
            server_config=self.config.public_items() | {"port": str(self.port)},
            in_flight_requests=len(engine.streams), uptime_seconds=time.monotonic() - self.started_at,
        )
        if engine.info is not None:
            reply.engine_config.update(engine.info.engine_config)
            reply.graph_keys.extend(pb.GraphKey(num_extends=k[0], q_len_per_req=k[1], bs=k[2], num_tokens=k[3])
                                    for k in engine.info.graph_keys)
        stats = engine.stats
        if stats is not None:
            reply.kv_cache.CopyFrom(pb.KvCacheUsage(page_size=engine.info.page_size, pages_total=stats.kv_pages_total,
                                                    pages_free=stats.kv_pages_free, usage=stats.kv_usage,
                                                    pages_cached=stats.kv_pages_cached))
            reply.running_requests, reply.waiting_requests = stats.running, stats.waiting
            reply.steps.update(stats.steps)
            reply.graph_replays, reply.compiled_steps, reply.eager_steps = (stats.graph_replays, stats.compiled_steps,
                                                                            stats.eager_steps)
            reply.preemptions, reply.kernel_compiles = stats.preemptions, stats.kernel_compiles
            reply.prefix_cache_query_tokens = stats.prefix_cache_query_tokens
            reply.prefix_cache_hit_tokens = stats.prefix_cache_hit_tokens
            reply.engine_step_seconds = stats.step_seconds
        return reply

    # ---- helpers ---------------------------------------------------------------------------

    def _request_parser(self) -> RequestParser:
        if self._parser is None:  # built on first use: vocab and context length come from the engine
            info = self.engine.info
            self._parser = RequestParser(self.tokenizer, info.vocab_size, info.max_model_len,
                                         speculative=info.speculative_method is not None)
        return self._parser

    async def _check_message(self, request, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, MalformedMessage):
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, request.error)

    async def _check_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self.engine.failure is not None:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE,
                               f"{self.engine.failure}; the server is NOT_SERVING")
        if self.engine.info is None:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE,
                               "the engine is still warming up; retry once health reports SERVING")

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.metrics.observe_rejection(code.name)
        await context.abort(code, message)


def _without_stop_strings(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, stop=())


def _lenient(message_type: type[Message]) -> Callable[[bytes], Message | MalformedMessage]:
    def deserialize(data: bytes) -> Message | MalformedMessage:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return MalformedMessage(f"the request is not a valid {message_type.DESCRIPTOR.full_name} message: {exc}")

    return deserialize


def method_handlers(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, with lenient request decoding (see the module docstring)."""
    methods = {
        "Generate": (grpc.unary_stream_rpc_method_handler, servicer.Generate, pb.GenerateRequest, pb.GenerateResponse),
        "Abort": (grpc.unary_unary_rpc_method_handler, servicer.Abort, pb.AbortRequest, pb.AbortResponse),
        "GetModelInfo": (grpc.unary_unary_rpc_method_handler, servicer.GetModelInfo, pb.GetModelInfoRequest,
                         pb.ModelInfo),
        "GetServerInfo": (grpc.unary_unary_rpc_method_handler, servicer.GetServerInfo, pb.GetServerInfoRequest,
                          pb.ServerInfo),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        name: make(behavior, request_deserializer=_lenient(request), response_serializer=response.SerializeToString)
        for name, (make, behavior, request, response) in methods.items()
    })
