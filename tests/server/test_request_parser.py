"""RequestParser without a server: defaults, explicit zeros, and a message naming each bad field."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from encore.engine.tokenizer import load_tokenizer
from encore.protos.encore.v1 import generate_pb2 as pb
from encore.server.client import build_request
from encore.server.request_parser import INLINE_TOKENIZE_CHARS, RequestError, RequestParser

VOCAB, MAX_LEN = 320, 64


@pytest.fixture(scope="module")
def parser(v3_dir):
    parser = RequestParser(load_tokenizer(v3_dir), VOCAB, MAX_LEN)
    yield parser
    parser.close()


def parse(parser: RequestParser, request: pb.GenerateRequest):
    return asyncio.run(parser.parse(request))


def error(parser: RequestParser, request: pb.GenerateRequest) -> RequestError:
    with pytest.raises(RequestError) as err:
        parse(parser, request)
    return err.value


def test_unset_options_take_defaults_and_explicit_zeros_are_kept(parser):
    parsed = parse(parser, build_request([5, 6, 7]))
    assert parsed.prompt_token_ids == [5, 6, 7]
    assert parsed.params.temperature == 1.0 and parsed.params.logprobs is None
    assert parsed.params.max_tokens == MAX_LEN - 3  # until the context is full
    parsed = parse(parser, build_request([5], temperature=0.0, top_k=0, logprobs=0, seed=0, max_tokens=7))
    assert (parsed.params.temperature, parsed.params.logprobs, parsed.params.seed) == (0.0, 0, 0)
    assert parsed.params.max_tokens == 7


def test_min_tokens_reaches_the_sampling_params_and_not_with_a_response_format(parser):
    parsed = parse(parser, build_request([5, 6, 7], min_tokens=MAX_LEN - 3))  # all the context leaves
    assert (parsed.params.min_tokens, parsed.params.max_tokens) == (MAX_LEN - 3, MAX_LEN - 3)
    assert parse(parser, build_request([5], min_tokens=0, max_tokens=3)).params.min_tokens == 0
    request = build_request([5], min_tokens=2)
    request.response_format.regex = "[a-z]+"
    err = error(parser, request)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message.startswith("stopping.min_tokens=2 cannot be combined with response_format"), err.message


def test_text_is_tokenized_like_the_engine_does(parser, reference):
    parsed = parse(parser, build_request("def fibonacci(n):", stop=["\n"]))
    assert parsed.prompt_token_ids == reference.tokenizer.encode("def fibonacci(n):")
    assert parsed.params.stop == ("\n",)


def test_long_text_is_tokenized_on_the_worker_like_the_engine_does(parser, reference, monkeypatch):
    threads = []
    encode = parser._encode
    monkeypatch.setattr(parser, "_encode", lambda text: threads.append(threading.current_thread().name) or encode(text))
    text = "x" * (INLINE_TOKENIZE_CHARS + 1)  # past the inline limit: tokenized on the worker thread
    n = len(reference.tokenizer.encode(text))
    assert error(parser, build_request(text)).message.startswith(f"the prompt has {n} tokens; max_model_len is")
    error(parser, build_request("x" * INLINE_TOKENIZE_CHARS))  # at the limit: inline, on the event loop's thread
    assert threads[0].startswith("encore-tokenize") and threads[1] == threading.current_thread().name


@pytest.mark.parametrize(("options", "field"), [
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(temperature=float("nan")), "sampling.temperature"),
    (dict(temperature=1e300), "sampling.temperature"),  # finite, but inf in the sampler's float32
    (dict(repetition_penalty=1e-300), "sampling.repetition_penalty"),  # 0 in float32
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=float("inf")), "sampling.top_p"),
    (dict(min_p=1.5), "sampling.min_p"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(presence_penalty=2.5), "sampling.presence_penalty"),
    (dict(frequency_penalty=-3.0), "sampling.frequency_penalty"),
    (dict(seed=2**63), "sampling.seed"),
    (dict(max_tokens=0), "stopping.max_tokens"),
    (dict(stop=[""]), "stopping.stop"),
    (dict(stop=["x"] * 17), "stopping.stop"),
    (dict(stop=["x" * 257]), "stopping.stop[0]"),
    (dict(stop_token_ids=[VOCAB]), "stopping.stop_token_ids"),
    (dict(min_tokens=5, max_tokens=4), "stopping.min_tokens"),
    (dict(min_tokens=MAX_LEN), "stopping.min_tokens"),  # max_tokens unset: more than the context leaves
    (dict(logprobs=21), "logprobs"),
    (dict(request_id="x" * 129), "request_id"),
    (dict(request_id="a\nb"), "request_id"),
])
def test_bad_option_is_invalid_argument_naming_the_field(parser, options, field):
    err = error(parser, build_request([5], **options))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message.startswith(field), err.message


@pytest.mark.parametrize(("request_", "field"), [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(text=""), "text"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, VOCAB + 5])), "token_ids.ids[2]"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * MAX_LEN)), "token_ids.ids"),
    (pb.GenerateRequest(text="fox " * MAX_LEN), "the prompt has"),
], ids=["none", "empty-text", "empty-ids", "bad-id", "long-ids", "long-text"])
def test_bad_prompt_is_invalid_argument(parser, request_, field):
    err = error(parser, request_)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message.startswith(field), err.message


def test_text_needs_a_tokenizer():
    parser = RequestParser(None, VOCAB, MAX_LEN)
    assert error(parser, pb.GenerateRequest(text="hi")).message.startswith("text: the model directory has no tokenizer")
    assert parse(parser, build_request([1, 2])).prompt_token_ids == [1, 2]
    parser.close()


@pytest.mark.parametrize(("kind", "source", "valid"), [
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}', True),
    ("json_schema", "true", True),
    ("json_schema", "{not json", False),
    ("json_schema", '{},"]', False),
    ("json_schema", "[1, 2]", False),
    ("json_schema", '{"type": 5}', False),
    ("json_schema", '{"$ref": "#/missing"}', False),
    ("regex", "[a-z]+@[a-z]+\\.com", True),
    ("regex", "[a-", False),
    ("regex", "(unclosed", False),
    ("regex", "", False),
    ("ebnf", 'root ::= "yes" | "no"', True),
    ("ebnf", "root ::= ", False),
    ("ebnf", 'other ::= "x"', False),
])
def test_a_valid_grammar_reaches_the_sampling_params_and_a_bad_one_is_invalid(parser, kind, source, valid):
    request = build_request([5])
    setattr(request.response_format, kind, source)
    if valid:
        params = parse(parser, request).params
        assert getattr(params, kind) == source and params.grammar.kind == kind
    else:
        err = error(parser, request)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message.startswith(f"response_format.{kind}")


def test_json_object_is_passed_on_and_an_empty_response_format_constrains_nothing(parser):
    request = build_request([5])
    request.response_format.json_object.SetInParent()
    params = parse(parser, request).params
    assert params.json_object and params.grammar.kind == "json_object"
    request = pb.GenerateRequest(text="x", speculative=False)
    request.response_format.SetInParent()  # set but empty: constrains nothing
    parsed = parse(parser, request)
    assert parsed.prompt_token_ids and parsed.params.grammar is None


def test_speculative_true_without_server_speculation_is_invalid_and_names_the_server_flag(parser):
    err = error(parser, pb.GenerateRequest(text="x", speculative=True))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "--speculative-method" in err.message
    assert err.message.startswith("speculative")
    assert parse(parser, pb.GenerateRequest(text="x", speculative=False)).params.speculative is False


def test_speculative_flag_is_passed_on_when_the_server_speculates(v3_dir):
    parser = RequestParser(load_tokenizer(v3_dir), VOCAB, MAX_LEN, speculative=True)
    try:
        assert parse(parser, pb.GenerateRequest(text="x", speculative=True)).params.speculative is True
        assert parse(parser, pb.GenerateRequest(text="x", speculative=False)).params.speculative is False
        assert parse(parser, pb.GenerateRequest(text="x")).params.speculative is None
    finally:
        parser.close()


def test_structured_output_without_a_tokenizer_is_invalid():
    parser = RequestParser(None, VOCAB, MAX_LEN)
    try:
        request = build_request([5])
        request.response_format.regex = "(yes|no)"
        err = error(parser, request)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "tokenizer" in err.message
    finally:
        parser.close()
