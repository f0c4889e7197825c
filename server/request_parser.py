"""Turns a GenerateRequest into the engine's inputs, or a RequestError naming the bad field.

Cheap checks run first, on the event loop. Tokenizing a long text prompt and parsing a grammar run on
one worker thread, so that a long prompt does not stall the other streams (one thread, not a pool: a
HF fast tokenizer must not be entered by two threads at once; its Rust calls hold the GIL, so the
loop's own encodes and decodes never overlap the worker's). A prompt of at most
``INLINE_TOKENIZE_CHARS`` characters (well under a millisecond) is tokenized on the loop: handing it
to the worker costs more than tokenizing it, since the worker gets the GIL back from a busy loop only
at the 5 ms switch interval: in a burst of 64 short prompts on a 2-core host the hand-over held
requests ~13 ms (median) between arrival and submission to the engine, inline ~0.3 ms. Sampling
values are validated by ``SamplingParams`` itself (one source of truth with the engine); its messages
are re-addressed to the proto field the client set.

A ``response_format`` (JSON schema, regex, EBNF or any JSON object) is parsed here with the engine's
own ``grammar_spec``, so a bad grammar gets INVALID_ARGUMENT with xgrammar's reason before it reaches
the engine, and a good one is passed on in the ``SamplingParams``. The per-request ``speculative``
flag opts a request out of (false) or into (true) the server's speculative decoding; true on a server
started without it (``encore serve --speculative-method``) is refused, never silently ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from encore.engine import SamplingParams
from encore.engine.tokenizer import prompt_encoder
from encore.engine.grammar import grammar_spec
from encore.protos.encore.v1 import generate_pb2 as pb

MAX_REQUEST_ID_CHARS = 128
INLINE_TOKENIZE_CHARS = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
# SamplingParams names its fields; the client set these proto fields.
_PROTO_PATHS = {name: f"sampling.{name}" for name in (*_FLOAT_FIELDS, "top_k", "seed")} | {
    "max_tokens": "stopping.max_tokens", "stop": "stopping.stop", "stop_token_ids": "stopping.stop_token_ids",
    "min_tokens": "stopping.min_tokens",
}


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams  # with the stop strings, which the server matches (see request_stream)


class RequestParser:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, speculative: bool = False) -> None:
        """``speculative``: whether the server runs speculative decoding."""
        self.tokenizer = tokenizer
        self._encode = prompt_encoder(tokenizer)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.speculative = speculative
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encore-tokenize")

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def parse(self, request: pb.GenerateRequest) -> ParsedRequest:
        check_request_id(request.request_id)
        token_ids = self._token_ids(request)
        if request.HasField("speculative") and request.speculative and not self.speculative:
            raise invalid("speculative: true, but the server runs without speculative decoding (start it with "
                          "`encore serve --speculative-method`); leave this unset or false")
        params = self._params(request)
        if request.HasField("response_format"):
            grammar = await self._grammar(request.response_format)
            if grammar and params.min_tokens:
                raise invalid(f"stopping.min_tokens={params.min_tokens} cannot be combined with response_format: "
                              "its grammar may allow nothing but a stop token")
            params = dataclasses.replace(params, **grammar)
        if token_ids is None:
            token_ids = await self._tokenize(request.text)
        if len(token_ids) >= self.max_model_len:
            raise invalid(f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                          f"so at most {self.max_model_len - 1} fit and leave room to generate")
        if not request.stopping.HasField("max_tokens"):  # unset: until the context is full
            room = self.max_model_len - len(token_ids)
            if params.min_tokens > room:
                raise invalid(f"stopping.min_tokens={params.min_tokens}, but the prompt's {len(token_ids)} tokens "
                              f"leave room for {room} in max_model_len {self.max_model_len}")
            params = dataclasses.replace(params, max_tokens=room)
        return ParsedRequest(token_ids, params)

    def _token_ids(self, request: pb.GenerateRequest) -> list[int] | None:
        """The prompt's ids if it came as ids (checked), None if it is text (checked, not tokenized)."""
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise invalid("prompt: set text or token_ids")
        if kind == "text":
            if not request.text:
                raise invalid("text is empty: the prompt needs at least one token")
            if self.tokenizer is None:
                raise invalid("text: the model directory has no tokenizer; send token_ids instead")
            return None
        ids = request.token_ids.ids
        if not ids:
            raise invalid("token_ids.ids is empty: the prompt needs at least one token")
        if len(ids) >= self.max_model_len:
            raise invalid(f"token_ids.ids has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                          f"so at most {self.max_model_len - 1} fit and leave room to generate")
        ids = list(ids)
        if max(ids) >= self.vocab_size:
            i = next(i for i, t in enumerate(ids) if t >= self.vocab_size)
            raise invalid(f"token_ids.ids[{i}] = {ids[i]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _params(self, request: pb.GenerateRequest) -> SamplingParams:
        sampling, stopping = request.sampling, request.stopping
        kwargs = {}
        for name in _FLOAT_FIELDS:
            if sampling.HasField(name):
                value = getattr(sampling, name)
                if not math.isfinite(value):
                    raise invalid(f"sampling.{name} must be a finite number, got {value}")
                kwargs[name] = value
        if sampling.HasField("top_k"):
            # Any top_k past the vocabulary means no top-k filter; clamping keeps a uint32 from the
            # wire inside the sampler's int32 column (2**31 and up would fail the whole step).
            kwargs["top_k"] = min(sampling.top_k, self.vocab_size)
        if sampling.HasField("seed"):
            kwargs["seed"] = sampling.seed
        if stopping.HasField("max_tokens"):
            kwargs["max_tokens"] = stopping.max_tokens
        else:  # until the context is full: set once the prompt is tokenized (and min_tokens checked then)
            kwargs["max_tokens"] = max(self.max_model_len, stopping.min_tokens)
        if stopping.HasField("min_tokens"):
            kwargs["min_tokens"] = stopping.min_tokens
        if len(stopping.stop) > MAX_STOP_STRINGS:
            raise invalid(f"stopping.stop has {len(stopping.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for i, s in enumerate(stopping.stop):
            if len(s) > MAX_STOP_CHARS:
                raise invalid(f"stopping.stop[{i}] has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")
        if request.HasField("logprobs"):
            kwargs["logprobs"] = request.logprobs
        if request.HasField("speculative"):
            kwargs["speculative"] = request.speculative
        try:
            params = SamplingParams(stop=tuple(stopping.stop), stop_token_ids=tuple(stopping.stop_token_ids),
                                    ignore_eos=stopping.ignore_eos, **kwargs)
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            raise invalid(_proto_path(str(exc))) from None
        return params

    async def _grammar(self, response_format: pb.ResponseFormat) -> dict[str, str | bool]:
        """The SamplingParams fields that carry a response_format, after its grammar parsed."""
        kind = response_format.WhichOneof("format")
        if kind is None:
            return {}  # an empty ResponseFormat constrains nothing
        if self.tokenizer is None:
            raise invalid(f"response_format.{kind}: structured output needs the model's tokenizer, "
                          "and the model directory has none")
        given = {"json_object": True} if kind == "json_object" else {kind: getattr(response_format, kind)}
        if kind == "json_schema":
            # xgrammar's JSON reader stops after the first value and ignores what follows ("{},]" reads
            # as {}): the wire field must be JSON text, so check that strictly first.
            try:
                json.loads(response_format.json_schema)
            except json.JSONDecodeError as exc:
                raise invalid(f"response_format.json_schema is not JSON: {exc}") from None
        try:
            spec = grammar_spec(**({"json_schema": None, "regex": None, "ebnf": None, "json_object": False} | given))
            await asyncio.get_running_loop().run_in_executor(self._worker, spec.parse)
        except ValueError as exc:
            raise invalid(f"response_format.{kind}: {exc}") from None
        return given

    async def _tokenize(self, text: str) -> list[int]:
        if len(text) <= INLINE_TOKENIZE_CHARS:
            ids = self._encode(text)
        else:
            ids = await asyncio.get_running_loop().run_in_executor(self._worker, self._encode, text)
        if not ids:
            raise invalid("text tokenizes to no tokens: the prompt needs at least one")
        return ids


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")
    if not request_id.isprintable():
        raise invalid(f"request_id {request_id!r} has non-printable characters")


def _proto_path(message: str) -> str:
    """Renames the SamplingParams field a message starts with to the proto field it came from."""
    field, _, rest = message.partition(" ")
    return f"{_PROTO_PATHS[field]} {rest}" if field in _PROTO_PATHS else message
