"""Queue limit, an engine step that fails, and message sizes, on a server of their own."""

from __future__ import annotations

import grpc
import pytest
from server_harness import ServerThread, engine_kwargs, wait_idle, wait_until
from faulty_engine import POISON, FaultyEngine

from encore.server.client import Client
from encore.server.config import ServerConfig


@pytest.fixture(scope="module")
def small(v3_dir):
    """max_num_seqs 2 + max_queued_requests 1: at most 3 requests in flight; a poison prompt fails steps
    (with a step in flight: the engine overlaps its steps, as on CUDA)."""
    config = ServerConfig(port=0, max_queued_requests=1, max_message_bytes=64 << 10)
    handle = ServerThread(config, engine_kwargs(v3_dir, max_num_seqs=2, overlap_schedule=True), FaultyEngine).listen()
    handle.start_engine()
    yield handle
    handle.stop()


def test_queue_over_its_limit_gets_resource_exhausted(small):
    with Client(small.target) as client:
        calls = [client.stream([3, i + 4], max_tokens=250, temperature=0.0, ignore_eos=True) for i in range(3)]
        wait_until(lambda: client.server_info().in_flight_requests == 3)  # two running, one queued
        with pytest.raises(grpc.RpcError) as err:
            client.generate([3], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit is 3" in err.value.details()
        for call in calls:
            call.cancel()
        wait_idle(client)
        assert client.generate([3], max_tokens=2).finish_reason in ("stop", "length")


def test_failed_engine_step_is_internal_for_its_requests_and_the_server_goes_on(small):
    with Client(small.target) as client:
        bystander = client.stream([3, 9], max_tokens=250, temperature=0.0, ignore_eos=True)
        next(bystander)
        with pytest.raises(grpc.RpcError) as err:
            client.generate(POISON, max_tokens=4)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "injected fault" in err.value.details() and "goes on serving" in err.value.details()
        # Everything in the failed step was aborted, since its state may be half-updated.
        with pytest.raises(grpc.RpcError) as err:
            list(bystander)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        info = wait_idle(client)
        assert info.engine_alive and client.health() == "SERVING"
        assert client.generate([3, 9], max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


def test_message_over_the_size_limit_is_refused(small):
    with Client(small.target, max_message_bytes=1 << 20) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x" * (100 << 10), max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.generate([3], max_tokens=2).usage.completion_tokens >= 1
