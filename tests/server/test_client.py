"""The Python clients: sync and asyncio agree, and cancelling a stream frees the request."""

from __future__ import annotations

import asyncio

from server_harness import API_KEY, wait_idle

from encore.server.client import AsyncClient, Client, build_request


def test_build_request_leaves_unset_options_unset():
    request = build_request("hi", temperature=0.0, max_tokens=5, stop=["\n"], logprobs=0)
    assert request.text == "hi" and request.sampling.HasField("temperature") and request.sampling.temperature == 0
    assert not request.sampling.HasField("top_p") and not request.sampling.HasField("seed")
    assert request.HasField("logprobs") and request.logprobs == 0
    assert list(request.stopping.stop) == ["\n"] and request.stopping.max_tokens == 5
    assert list(build_request([1, 2]).token_ids.ids) == [1, 2] and not build_request([1]).HasField("logprobs")


def test_sync_and_async_clients_agree(server, client):
    options = dict(max_tokens=10, temperature=0.0, logprobs=1)
    sync = client.generate("The quick brown fox", **options)

    async def run():
        async with AsyncClient(server.target, api_key=API_KEY) as aclient:
            assert await aclient.health() == "SERVING"
            assert (await aclient.model_info()).vocab_size == 320
            assert (await aclient.server_info()).ready
            return await aclient.generate("The quick brown fox", **options)

    asynchronous = asyncio.run(run())
    assert (sync.token_ids, sync.text, sync.finish_reason) == (asynchronous.token_ids, asynchronous.text,
                                                                asynchronous.finish_reason)
    assert sync.usage == asynchronous.usage and len(sync.logprobs) == len(sync.token_ids)
    assert sync.request_id != asynchronous.request_id


def test_cancelling_a_stream_frees_its_request(server):
    with Client(server.target, api_key=API_KEY) as client:
        call = client.stream([8, 9], max_tokens=250, ignore_eos=True)
        next(call)
        assert client.server_info().in_flight_requests >= 1
        call.cancel()
        wait_idle(client)
