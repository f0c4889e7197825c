"""Several gRPC listeners on one port (ServerConfig.listeners): each serves the API behind the same
API-key check, the kernel deals client connections out among them, and the port must be free."""

from __future__ import annotations

import re

import grpc
import pytest
from server_harness import API_KEY, ServerThread, engine_kwargs

from encore.protos.encore.v1 import generate_pb2 as pb
from encore.server.config import ServerConfig
from encore.server.servicer import SERVICE_NAME


def _listener_calls(handle: ServerThread) -> list[int]:
    found = re.findall(r'^encore_listener_calls_total\{listener="(\d+)"\} (\d+)$', handle.server.render_metrics(),
                       re.MULTILINE)
    return [int(n) for _, n in sorted(found, key=lambda pair: int(pair[0]))]


def test_connections_are_spread_over_the_listeners_and_every_one_checks_the_api_key(v3_dir):
    handle = ServerThread(ServerConfig(port=0, api_key=API_KEY, listeners=4), engine_kwargs(v3_dir)).listen()
    # A local subchannel pool: each channel opens its own connection instead of sharing one.
    channels = [grpc.insecure_channel(handle.target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(48)]
    try:
        for channel in channels:
            info = channel.unary_unary(f"/{SERVICE_NAME}/GetServerInfo",
                                       request_serializer=pb.GetServerInfoRequest.SerializeToString,
                                       response_deserializer=pb.ServerInfo.FromString)
            with pytest.raises(grpc.RpcError) as err:
                info(pb.GetServerInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = info(pb.GetServerInfoRequest(), metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=5)
            assert reply.server_config["listeners"] == "4"
            assert reply.server_config["port"] == str(handle.server.port)
        calls = _listener_calls(handle)
        assert len(calls) == 4 and sum(calls) == 2 * len(channels)
        # Each of 48 connections goes to one of 4 listeners: all of them get some but for ~1e-5 of runs.
        assert min(calls) > 0, calls
    finally:
        for channel in channels:
            channel.close()
        handle.stop()


@pytest.mark.parametrize(("first", "second"), [(1, 4), (4, 4), (4, 1)])
def test_a_second_server_on_a_taken_port_fails_to_start_and_says_where(v3_dir, first, second):
    holder = ServerThread(ServerConfig(port=0, listeners=first), engine_kwargs(v3_dir)).listen()
    try:
        port = holder.server.port
        late = ServerThread(ServerConfig(port=port, listeners=second), engine_kwargs(v3_dir))
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            late.listen()
        late.stop()
    finally:
        holder.stop()
