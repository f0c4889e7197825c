"""A server started with speculative decoding: streams keep the greedy tokens, report the drafts their
request accepted, and a request may opt out per call (its tokens unchanged, nothing accepted)."""

from __future__ import annotations

import pytest
from server_harness import ServerThread, engine_kwargs, wait_idle

from encore.engine import Engine, SamplingParams
from encore.protos.encore.v1 import generate_pb2 as pb
from encore.server.client import Client, build_request
from encore.server.config import ServerConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2


@pytest.fixture(scope="module")
def spec_client(v3_dir):
    handle = ServerThread(ServerConfig(port=0), engine_kwargs(v3_dir, speculative=SPEC)).listen()
    handle.start_engine()
    with Client(handle.target) as client:
        yield client
    handle.stop()


def stream(client: Client, speculative: bool | None) -> list[pb.GenerateResponse]:
    request = build_request(PROMPT, max_tokens=32, temperature=0.0, speculative=speculative)
    return list(client.stub.Generate(request, metadata=client.metadata))


def test_per_request_speculation_toggle(spec_client, v3_dir):
    want = Engine(**engine_kwargs(v3_dir)).generate([PROMPT], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert spec_client.model_info().supports_speculative
    for speculative in (None, True, False):
        chunks = stream(spec_client, speculative)
        assert [t for c in chunks for t in c.token_ids] == want.token_ids, speculative
        accepted = chunks[-1].usage.spec_accepted_tokens
        if speculative is False:
            assert accepted == 0
        else:
            assert accepted > 0  # the prompt repeats itself: n-gram drafts get accepted
    info = wait_idle(spec_client)
    assert info.kv_cache.pages_free == info.kv_cache.pages_total
