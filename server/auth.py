"""API-key check: every call must carry ``authorization: Bearer <key>`` in its metadata.

Health checks and reflection are exempt: load balancers probe health without credentials, and
reflection only describes the public API.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES) or self._authorized(details):
            return handler
        return _denying(handler)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                # compare_digest: the time taken must not reveal how much of the key matched.
                return hmac.compare_digest(value.encode(), self._expected)
        return False


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that ends the call with UNAUTHENTICATED without reading it."""

    async def deny(request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong API key: send the metadata 'authorization: Bearer <key>'")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)
