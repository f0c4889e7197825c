"""Generate through a real gRPC channel on localhost against Engine.generate in-process."""

from __future__ import annotations

import asyncio
import math
import re

import grpc
import pytest
from server_harness import API_KEY, wait_idle

from encore.engine import SamplingParams
from encore.protos.encore.v1 import generate_pb2 as pb
from encore.protos.encore.v1.generate_pb2_grpc import GenerationServiceStub
from encore.server.client import AsyncClient, Client, build_request

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Ünïcödé — 日本語", [5, 9, 40, 41, 200, 3], [17]]


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: repr(p)[:20])
def test_greedy_stream_equals_engine_generate(client, reference, prompt):
    want = reference.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, logprobs=2))[0]
    chunks = list(client.stream(prompt, max_tokens=24, temperature=0.0, logprobs=2))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == want.token_ids
    assert "".join(c.text for c in chunks) == want.text
    assert chunks[-1].finish_reason == {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}[
        want.finish_reason]
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not c.HasField("usage") for c in chunks[:-1])
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == want.token_ids
    for got, ref in zip(logprobs, want.logprobs):
        assert math.isclose(got.logprob, ref.logprob, rel_tol=1e-5, abs_tol=1e-5)
        assert [t.token_id for t in got.top] == [t for t, _ in ref.top]


def test_seeded_sampling_equals_engine_generate(client, reference):
    params = dict(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, repetition_penalty=1.1)
    want = reference.generate(["The quick"], SamplingParams(**params))[0]
    got = client.generate("The quick", **params)
    assert (got.token_ids, got.text) == (want.token_ids, want.text)


def test_stop_string_ends_the_stream_where_the_engine_does(client, reference):
    """Stop strings are matched in the server process; the result must be the engine's."""
    free = reference.generate(["def fibonacci(n):"], SamplingParams(max_tokens=40, temperature=0.0,
                                                                  ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2:][:3]
    assert stop, "the reference produced no text to stop on"
    want = reference.generate(["def fibonacci(n):"], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                                  stop=(stop,)))[0]
    assert want.finish_reason == "stop"
    got = client.generate("def fibonacci(n):", max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    assert got.usage.completion_tokens == len(want.token_ids)
    wait_idle(client)  # the engine, a step ahead, was told to abort: nothing stays behind


def test_min_tokens_holds_off_stop_strings_and_ids_as_the_engine_does(client, reference):
    """A stop string and a stop id the greedy text reaches early: with min_tokens the stream runs past
    them as Engine.generate does (the server matches the stop string, the engine masks the id)."""
    prompt = "def fibonacci(n):"
    free = reference.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    stop, stop_id = free.text[1:3], free.token_ids[2]
    options = dict(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,), stop_token_ids=(stop_id,))
    early = reference.generate([prompt], SamplingParams(**options))[0]
    want = reference.generate([prompt], SamplingParams(min_tokens=12, **options))[0]
    assert len(early.token_ids) <= 3 < 12 <= len(want.token_ids)
    got = client.generate(prompt, min_tokens=12, **options)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    wait_idle(client)


def test_request_id_can_be_reused_once_its_stream_has_ended(client, reference):
    """A stop string ends the stream while the engine still holds the request; the id is free at once."""
    free = reference.generate(["The quick brown fox"], SamplingParams(max_tokens=30, temperature=0.0,
                                                                    ignore_eos=True))[0]
    stop = free.text[len(free.text) // 3:][:2]
    for _ in range(5):
        got = client.generate("The quick brown fox", request_id="again", max_tokens=30, temperature=0.0,
                              ignore_eos=True, stop=[stop])
        assert got.finish_reason == "stop" and got.request_id == "again"
    wait_idle(client)


def test_unset_max_tokens_runs_to_the_context_length(client):
    info = client.model_info()
    got = client.generate([3] * 240, temperature=0.0, ignore_eos=True)
    assert got.finish_reason == "length"
    assert len(got.token_ids) == info.max_model_len - 240


def test_64_concurrent_streams_complete_without_lost_or_duplicated_deltas(server, reference):
    prompts = [[(7 * i + j) % 300 + 2 for j in range(3 + i % 11)] for i in range(64)]
    params = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = reference.generate(prompts, SamplingParams(**params))

    async def one(client: AsyncClient, prompt: list[int]):
        return [r async for r in client.stream(prompt, **params)]

    async def run():
        async with AsyncClient(server.target, api_key=API_KEY) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    streams = asyncio.run(run())
    request_ids = set()
    for chunks, ref in zip(streams, want):
        request_ids.add(chunks[0].request_id)
        assert {c.request_id for c in chunks} == {chunks[0].request_id}
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids
        assert "".join(c.text for c in chunks) == ref.text
        assert chunks[-1].usage.completion_tokens == 16
        assert sum(c.finish_reason != pb.FINISH_REASON_UNSPECIFIED for c in chunks) == 1
    assert len(request_ids) == 64


def test_cancel_and_disconnect_mid_stream_200_times_leak_no_pages(server):
    """Half the clients cancel their call, half drop their channel, each after its first delta."""

    async def cancel(client: AsyncClient, i: int) -> None:
        call = client.stream([2 + i % 50, 9, 11], max_tokens=200, temperature=0.0, ignore_eos=True)
        await call.read()
        call.cancel()

    async def disconnect(i: int) -> None:
        # A channel of its own (not sharing gRPC's global connection pool): closing it drops the connection.
        channel = grpc.aio.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
        request = build_request([2 + i % 50, 13], max_tokens=200, temperature=0.0, ignore_eos=True)
        call = GenerationServiceStub(channel).Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),))
        await call.read()
        await channel.close(grace=None)

    cancelled_before = server.server.metrics.finished["cancelled"]

    async def run():
        async with AsyncClient(server.target, api_key=API_KEY) as client:
            for wave in range(10):
                await asyncio.gather(*(cancel(client, 20 * wave + i) if i % 2 else disconnect(20 * wave + i)
                                       for i in range(20)))

    asyncio.run(run())
    with Client(server.target, api_key=API_KEY) as client:
        info = wait_idle(client)
    assert info.kv_cache.pages_free == info.kv_cache.pages_total > 0
    assert server.server.metrics.finished["cancelled"] == cancelled_before + 200


def test_deadline_is_honoured_and_frees_the_request(client):
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream([5, 6, 7], max_tokens=250, temperature=0.0, ignore_eos=True, timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(client)
    got = client.generate([5, 6, 7], max_tokens=4, temperature=0.0, timeout=30)
    assert len(got.token_ids) <= 4 and got.finish_reason in ("stop", "length")


def test_abort_ends_the_stream_with_finish_reason_abort(client):
    call = client.stream([4, 5, 6], request_id="to-abort", max_tokens=250, temperature=0.0, ignore_eos=True)
    first = next(call)
    assert first.request_id == "to-abort"
    client.abort("to-abort")
    rest = list(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) < 250
    with pytest.raises(grpc.RpcError) as err:
        client.abort("to-abort")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    wait_idle(client)


def test_request_id_in_use_is_refused(client):
    call = client.stream([4, 5], request_id="twice", max_tokens=250, temperature=0.0, ignore_eos=True)
    next(call)
    with pytest.raises(grpc.RpcError) as err:
        client.generate([4, 5], request_id="twice", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "twice" in err.value.details()
    call.cancel()
    wait_idle(client)


def test_regex_constrained_greedy_stream_matches_the_regex_and_stops(client):
    request = build_request("The quick brown fox", max_tokens=16, temperature=0.0)
    request.response_format.regex = "(yes|no)"
    chunks = list(client.stub.Generate(request, metadata=client.metadata))
    assert re.fullmatch("(yes|no)", "".join(c.text for c in chunks))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    wait_idle(client)


def test_speculation_asked_of_a_server_without_it_is_refused_not_ignored(client):
    request = pb.GenerateRequest(text="x", speculative=True)
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(request, metadata=client.metadata))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--speculative-method" in err.value.details()
    request = pb.GenerateRequest(text="x", speculative=False)
    request.stopping.max_tokens = 2
    assert list(client.stub.Generate(request, metadata=client.metadata))[-1].usage.completion_tokens <= 2


def test_model_and_server_info(client, reference):
    model = client.model_info()
    assert model.vocab_size == reference.model_config.vocab_size
    assert model.max_model_len == reference.max_model_len
    assert set(model.eos_token_ids) == set(reference.eos_token_ids)
    assert model.has_tokenizer and model.supports_structured_output and not model.supports_speculative
    info = client.server_info()
    assert info.engine_alive and info.ready
    assert info.engine_config["max_num_seqs"] == "64" and info.engine_config["device"] == "cpu"
    assert info.server_config["api_key"] == "set" and API_KEY not in str(info)
    assert info.kv_cache.page_size == 16 and info.kv_cache.pages_total == 1023
    assert info.steps["EXTEND"] >= 1
    assert info.graph_replays + info.compiled_steps + info.eager_steps == sum(info.steps.values())
    assert info.engine_step_seconds > 0
    assert info.kernel_compiles == 0  # a CPU engine compiles no kernels
    assert list(info.graph_keys) == []


def test_a_shared_prefix_is_reported_as_cached_tokens(client, reference):
    prefix = [(37 * i + 11) % 250 + 50 for i in range(40)]  # two full pages of 16, then 8 tokens
    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = client.generate(prefix + [7], **params)
    before = client.server_info()
    second = client.generate(prefix + [9, 11], **params)
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 32
    assert second.token_ids == reference.generate([prefix + [9, 11]], SamplingParams(**params))[0].token_ids
    info = client.server_info()
    assert info.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 32
    assert info.prefix_cache_query_tokens - before.prefix_cache_query_tokens == 42
    assert info.kv_cache.pages_cached >= 2
