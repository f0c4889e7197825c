"""The Python clients: sync and asyncio agree, and cancelling a stream frees the request."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import API_KEY, wait_idle

from encore.server.client import AsyncClient, Client, build_request


def test_build_request_leaves_unset_options_unset():
    request = build_request("hi", temperature=0.0, max_tokens=5, stop=["\n"], logprobs=0)
    assert request.text == "hi" and request.sampling.HasField("temperature") and request.sampling.temperature == 0
    assert not request.sampling.HasField("top_p") and not request.sampling.HasField("seed")
    assert request.HasField("logprobs") and request.logprobs == 0
    assert list(request.stopping.stop) == ["\n"] and request.stopping.max_tokens == 5
    assert list(build_request([1, 2]).token_ids.ids) == [1, 2] and not build_request([1]).HasField("logprobs")


def test_build_request_takes_one_stop_string():
    assert list(build_request("hi", stop="\n\n").stopping.stop) == ["\n\n"]


@pytest.mark.parametrize("prompt, options, message", [
    ("hi", dict(max_tokens=-3), "max_tokens=-3: "),
    ("hi", dict(max_tokens=1.5), "max_tokens=1.5: "),
    ("hi", dict(top_k="40"), "top_k='40': "),
    ("hi", dict(temperature="hot"), "temperature='hot': "),
    ("hi", dict(seed=2 ** 64), "seed=18446744073709551616: "),
    ("hi", dict(stop=["a", 3]), r"stop=\['a', 3\]: "),
    ("hi", dict(stop_token_ids=[1, -2]), r"stop_token_ids=\[1, -2\]: "),
    ("hi", dict(logprobs=-1), "logprobs=-1: "),
    ([5, -1], {}, r"prompt=\[5, -1\]: "),
])
def test_build_request_names_a_value_the_message_cannot_hold(prompt, options, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        build_request(prompt, **options)


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
