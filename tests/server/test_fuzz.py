"""Hostile traffic: 1200 malformed or out-of-range requests from a seeded generator, sent 16 at a time
to the shared server. Each must end with the status its flaw calls for; afterwards the server still
serves, holds no request and no page, and a normal request succeeds."""

from __future__ import annotations

import asyncio
import random
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from server_harness import API_KEY, MAX_MODEL_LEN, wait_idle
from google.protobuf.message import DecodeError

from encore.protos.encore.v1 import generate_pb2 as pb
from encore.server.client import Client, build_request
from encore.server.servicer import SERVICE_NAME

NUM_CASES = 1200
VOCAB = 320
MESSAGE_LIMIT = 1 << 20  # the shared server's max_message_bytes
INVALID = grpc.StatusCode.INVALID_ARGUMENT
GOOD_KEY = (("authorization", f"Bearer {API_KEY}"),)


@dataclass(frozen=True)
class Case:
    name: str
    method: str  # "Generate", "Abort" or "GetModelInfo"
    payload: bytes
    expected: grpc.StatusCode
    metadata: tuple = GOOD_KEY


def _generate(name: str, request: pb.GenerateRequest, expected: grpc.StatusCode) -> Case:
    return Case(name, "Generate", request.SerializeToString(), expected)


def _base(rng: random.Random) -> pb.GenerateRequest:
    """A valid request with random, harmless options (max_tokens 1-2 keeps valid ones cheap)."""
    prompt = rng.choice([[rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))], "def f(x):", "fox"])
    options = rng.choice([{}, dict(temperature=0.0), dict(temperature=0.7, top_p=0.9, seed=rng.randrange(2**63)),
                          dict(top_k=rng.randrange(2**32), min_p=0.1), dict(logprobs=rng.randint(0, 20))])
    return build_request(prompt, max_tokens=rng.randint(1, 2), **options)


def _bad_sampling(rng):
    field, values = rng.choice([
        ("temperature", [-1e-9, -1.0, -1e300, float("nan"), float("inf")]),
        ("top_p", [0.0, -0.5, 1.0000001, 7.0, float("nan"), float("-inf")]),
        ("min_p", [-0.01, 1.01, float("nan"), float("inf")]),
        ("repetition_penalty", [0.0, -2.0, float("nan"), float("inf")]),
        ("presence_penalty", [-2.01, 2.01, 1e12, float("nan")]),
        ("frequency_penalty", [-1e12, 2.5, float("-inf")]),
    ])
    request = _base(rng)
    setattr(request.sampling, field, rng.choice(values))
    return _generate(f"sampling.{field}", request, INVALID)


def _bad_stopping(rng):
    request = _base(rng)
    kind = rng.choice(["max_tokens", "seed", "logprobs", "many_stops", "long_stop", "empty_stop", "stop_token",
                       "min_tokens"])
    if kind == "max_tokens":
        request.stopping.max_tokens = 0
    elif kind == "min_tokens":  # past max_tokens (1-2), or past what the context leaves when that is unset
        request.stopping.min_tokens = rng.randint(3, 2**32 - 1)
        if rng.random() < 0.5:
            request.stopping.ClearField("max_tokens")
            request.stopping.min_tokens = rng.randint(10**6, 2**32 - 1)
    elif kind == "seed":
        request.sampling.seed = rng.randrange(2**63, 2**64)
    elif kind == "logprobs":
        request.logprobs = rng.choice([21, 100, 2**32 - 1])
    elif kind == "many_stops":
        request.stopping.stop.extend(["s"] * rng.randint(17, 100))
    elif kind == "long_stop":
        request.stopping.stop.append("x" * rng.randint(257, 5000))
    elif kind == "empty_stop":
        request.stopping.stop.extend(["ok", ""])
    else:
        request.stopping.stop_token_ids.append(rng.randrange(VOCAB, 2**32))
    return _generate(kind, request, INVALID)


def _bad_prompt(rng):
    request = _base(rng)
    kind = rng.choice(["token_out_of_vocab", "empty_ids", "empty_text", "missing", "too_many_ids", "huge_text",
                       "request_id_long", "request_id_control"])
    if kind == "token_out_of_vocab":
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 50))]
        ids[rng.randrange(len(ids))] = rng.randrange(VOCAB, 2**32)
        request.token_ids.ids[:] = ids
    elif kind == "empty_ids":
        request.token_ids.SetInParent()
        del request.token_ids.ids[:]
    elif kind == "empty_text":
        request.text = ""
    elif kind == "missing":
        request.ClearField("text")
        request.ClearField("token_ids")
    elif kind == "too_many_ids":
        request.token_ids.ids[:] = [rng.randrange(VOCAB) for _ in range(rng.randint(MAX_MODEL_LEN, 50_000))]
    elif kind == "huge_text":
        request.text = "".join(rng.choices(string.printable + "é日🙂", k=rng.randint(4 * MAX_MODEL_LEN, 50_000)))
    elif kind == "request_id_long":
        request.request_id = "r" * rng.randint(129, 10_000)
    else:
        request.request_id = "id" + rng.choice(["\x00", "\n", "\x7f", "\u2028"]) + "x"
    return _generate(kind, request, INVALID)


def _response_format(rng):
    """A valid grammar is served (OK); a bad one is INVALID_ARGUMENT before it reaches the engine."""
    request = _base(rng)  # max_tokens 1-2: a constrained answer stays as cheap as any other
    kind, valid = rng.choice([("json_schema", True), ("json_schema", False), ("regex", True), ("regex", False),
                              ("ebnf", True), ("ebnf", False), ("json_object", True)])
    sources = {
        ("json_schema", True): ['{"type": "object"}', '{"type": "array", "items": {"type": "integer"}}', "true"],
        ("json_schema", False): ["{", "[]", "42", '{"type": 5}', '{"$ref": "#/nowhere"}', "\x00" * 10,
                                 '{"type": "array", "minItems": 100000}', "".join(rng.choices("{}[]:,\"", k=40))],
        ("regex", True): ["[a-z]+", "(yes|no)", "\\d{3}-\\d{4}"],
        ("regex", False): ["[a-", "(", "\\", "a{2,1}", "(?P<x"],
        ("ebnf", True): ['root ::= "a" | "b"', 'root ::= [0-9]+'],
        ("ebnf", False): ["root ::= ", 'x ::= "a"', "root ::= (", "::="],
    }
    if kind == "json_object":
        request.response_format.json_object.SetInParent()
    else:
        setattr(request.response_format, kind, rng.choice(sources[kind, valid]))
    return _generate(f"response_format.{kind}", request, grpc.StatusCode.OK if valid else INVALID)


def _speculative(rng):
    request = _base(rng)
    request.speculative = True
    return _generate("speculative", request, INVALID)  # the fuzzed server runs without speculation


def _undecodable(rng):
    """Bytes that are not a GenerateRequest (checked below with the real parser)."""
    noise = bytes(rng.randrange(256) for _ in range(rng.randint(0, 30)))
    payload = rng.choice([
        b"\x12\x7f" + noise[:100],          # text field claims 127 bytes, fewer follow
        b"\x12\x02\xff\xfe",                # text field with invalid UTF-8
        b"\x08" + b"\xff" * 11,             # varint that never ends
        b"\x0f" + noise,                    # wire type 7 does not exist
        b"\x1a\x05\x08\x01" + noise[:1],    # token_ids sub-message cut short
    ])
    return Case("undecodable", "Generate", payload, INVALID)


def _wrong_wire_type(rng):
    """Known fields sent with the wrong wire type decode as unknown fields: no prompt is set."""
    payload = rng.choice([b"\x10\x05", b"\x18\x07", b"\x1d\x00\x00\x00\x00"]) + b"\x22\x00"
    return Case("wrong_wire_type", "Generate", payload, INVALID)


def _bad_api_key(rng):
    metadata = rng.choice([(), (("authorization", API_KEY),), (("authorization", f"bearer {API_KEY}"),),
                           (("authorization", f"Bearer {API_KEY[:-1]}"),), (("authorization", f"Bearer {API_KEY} "),),
                           (("x-api-key", API_KEY),), (("authorization", "Bearer " + "k" * 2000),)])
    method = rng.choice(["Generate", "Abort", "GetModelInfo"])
    payload = _base(rng).SerializeToString() if method == "Generate" else b""
    return Case("api_key", method, payload, grpc.StatusCode.UNAUTHENTICATED, metadata)


def _other_methods(rng):
    kind = rng.choice(["abort_unknown", "abort_long_id", "abort_garbage", "info_garbage"])
    if kind == "abort_unknown":
        request = pb.AbortRequest(request_id="".join(rng.choices(string.ascii_letters, k=12)))
        return Case(kind, "Abort", request.SerializeToString(), grpc.StatusCode.NOT_FOUND)
    if kind == "abort_long_id":
        return Case(kind, "Abort", pb.AbortRequest(request_id="a" * 500).SerializeToString(), INVALID)
    return Case(kind, "Abort" if kind == "abort_garbage" else "GetModelInfo", b"\x0a\x09short", INVALID)


def _oversized(rng):
    request = build_request([300] * (MESSAGE_LIMIT // 2 + rng.randint(1, 1000)), max_tokens=1)  # 2 bytes each
    return _generate("oversized", request, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _valid(rng):
    request = _base(rng)
    if rng.random() < 0.1:  # a prompt that fills the context but one token: generates exactly one
        request.token_ids.ids[:] = [rng.randrange(VOCAB) for _ in range(MAX_MODEL_LEN - 1)]
        request.stopping.ClearField("max_tokens")
    return _generate("valid", request, grpc.StatusCode.OK)


GENERATORS: list[tuple[Callable[[random.Random], Case], float]] = [
    (_bad_sampling, 3), (_bad_stopping, 3), (_bad_prompt, 3), (_response_format, 2), (_speculative, 0.5),
    (_undecodable, 1), (_wrong_wire_type, 0.5), (_bad_api_key, 1.5), (_other_methods, 1), (_oversized, 0.05),
    (_valid, 0.5),
]


def make_cases(seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    functions, weights = zip(*GENERATORS)
    return [rng.choices(functions, weights)[0](rng) for _ in range(NUM_CASES)]


def test_the_cases_are_what_they_claim():
    """Undecodable payloads really fail to decode; wrong wire types decode to a request without prompt."""
    for case in make_cases():
        if case.name == "undecodable":
            try:
                pb.GenerateRequest.FromString(case.payload)
            except DecodeError:
                continue
            raise AssertionError(f"{case.payload!r} decodes")
        if case.name == "wrong_wire_type":
            assert pb.GenerateRequest.FromString(case.payload).WhichOneof("prompt") is None


async def _send(channel: grpc.aio.Channel, case: Case) -> tuple[grpc.StatusCode, str]:
    path = f"/{SERVICE_NAME}/{case.method}"
    try:
        if case.method == "Generate":
            call = channel.unary_stream(path, request_serializer=bytes,
                                        response_deserializer=pb.GenerateResponse.FromString)
            async for _ in call(case.payload, metadata=case.metadata, timeout=60):
                pass
        else:
            call = channel.unary_unary(path, request_serializer=bytes, response_deserializer=bytes)
            await call(case.payload, metadata=case.metadata, timeout=60)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_hostile_requests_get_the_right_status_and_the_server_survives(server):
    cases = make_cases()
    assert len(cases) >= 1000

    async def run():
        limit = asyncio.Semaphore(16)
        options = [("grpc.max_send_message_length", 8 << 20)]
        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            async def one(case: Case):
                async with limit:
                    return await _send(channel, case)

            return await asyncio.gather(*(one(c) for c in cases))

    results = asyncio.run(run())
    wrong = [(c.name, c.expected.name, code.name, details[:120])
             for c, (code, details) in zip(cases, results) if code != c.expected]
    assert not wrong, f"{len(wrong)} wrong statuses, e.g. {wrong[:5]}"
    assert all(details for c, (code, details) in zip(cases, results) if code == INVALID)
    seen = Counter(code.name for code, _ in results)
    assert set(seen) == {"INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND", "RESOURCE_EXHAUSTED", "OK"}

    with Client(server.target, api_key=API_KEY) as client:
        assert client.health() == "SERVING"
        info = wait_idle(client)
        assert info.engine_alive
        done = client.generate("def fibonacci(n):", max_tokens=8, temperature=0.0, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 8
