"""Health transitions over a server's life, reflection, and the API key."""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest
from server_harness import API_KEY, ServerThread, engine_kwargs, status_of, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from encore.protos.encore.v1 import generate_pb2 as pb
from encore.server.client import Client
from encore.server.config import ServerConfig
from encore.server.servicer import SERVICE_NAME


def _health(channel: grpc.Channel, service: str = "") -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def status_of_health(target: str) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        try:
            _health(channel)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_health_goes_serving_after_warm_up_and_not_serving_when_the_engine_dies(v3_dir):
    handle = ServerThread(ServerConfig(port=0), engine_kwargs(v3_dir)).listen()
    try:
        with Client(handle.target) as client:
            # Listening before the engine has warmed up: probes get an answer.
            assert client.health() == client.health(SERVICE_NAME) == "NOT_SERVING"
            assert status_of(client.stream("hi", max_tokens=2)) == grpc.StatusCode.UNAVAILABLE
            assert not client.server_info().ready
            handle.start_engine()
            assert handle.progress[0][0].startswith("loading") and "warming up" in handle.progress[-1][0]
            assert client.health() == client.health(SERVICE_NAME) == "SERVING"
            assert client.server_info().ready

            call = client.stream([3, 4], max_tokens=250, temperature=0.0, ignore_eos=True)
            next(call)
            os.kill(handle.server.engine.pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "engine process died" in err.value.details()
            wait_until(lambda: client.health() == "NOT_SERVING")
            assert client.health(SERVICE_NAME) == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as err:
                client.generate("hi", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "engine process died (exit code -9)" in err.value.details()
            info = client.server_info()  # the server itself keeps answering
            assert not info.engine_alive and not info.ready
    finally:
        handle.stop()


def test_stop_lets_running_streams_finish_within_the_grace_period(v3_dir):
    handle = ServerThread(ServerConfig(port=0, shutdown_grace_s=30.0), engine_kwargs(v3_dir)).listen()
    handle.start_engine()
    engine = handle.server.engine
    with Client(handle.target) as client:
        call = client.stream([3, 4], max_tokens=120, temperature=0.0, ignore_eos=True)
        first = next(call)
        stopping = threading.Thread(target=handle.stop)
        stopping.start()
        wait_until(lambda: status_of_health(handle.target) == grpc.StatusCode.UNAVAILABLE)  # no new calls
        rest = list(call)  # while the running stream goes on to its end
        stopping.join(30)
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 120
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert not engine._process.is_alive() and engine._process.exitcode == 0


def test_reflection_lists_the_services_and_describes_generate(server):
    with grpc.insecure_channel(server.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        service = database.FindFileContainingSymbol(SERVICE_NAME)
        methods = {m.name for s in service.service if s.name == "GenerationService" for m in s.method}
        assert methods == {"Generate", "Abort", "GetModelInfo", "GetServerInfo"}


def test_api_key_is_required_except_for_health(server):
    with grpc.insecure_channel(server.target) as channel:
        assert _health(channel) == "SERVING"  # exempt: load balancers probe without credentials
        stub_call = channel.unary_unary(f"/{SERVICE_NAME}/GetServerInfo",
                                        request_serializer=pb.GetServerInfoRequest.SerializeToString,
                                        response_deserializer=pb.ServerInfo.FromString)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)):
            with pytest.raises(grpc.RpcError) as err:
                stub_call(pb.GetServerInfoRequest(), metadata=metadata, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub_call(pb.GetServerInfoRequest(), metadata=(("authorization", f"Bearer {API_KEY}"),)).ready
