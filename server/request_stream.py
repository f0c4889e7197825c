"""One Generate call as the server process sees it: engine deltas in, response messages out.

Detokenization lives here, in the server process, and so does stop-string matching, because a stop
string is a property of the text. The engine process only sees token ids (it stops by itself on EOS,
stop token ids and length). When the text completes a stop string the stream finishes at the token
that completed it — the same tokens and text ``Engine.generate`` returns, since this reuses the
engine's ``IncrementalDetokenizer`` and feeds it tokens one at a time exactly as the engine does —
and the engine process, which may already be a step further, is told to abort the request.

Deltas that arrive while the handler is still sending are merged into one message, so a slow
client gets fewer, larger messages rather than a growing backlog of tiny ones.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from encore.engine.detokenizer import IncrementalDetokenizer
from encore.engine.request import TokenLogprob
from encore.protos.encore.v1 import generate_pb2 as pb
from encore.server.messages import Delta

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


class StreamError(Exception):
    """The request failed after it was accepted; the handler ends the call with this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RequestStream:
    """The server-side state of one request: what is still to be sent, timings, how it ended."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], stop: tuple[str, ...], tokenizer,
                 eos_token_ids: frozenset[int], arrival: float) -> None:
        self.request_id = request_id
        self.engine_id = ""  # given by EngineProcess.submit
        self.num_prompt_tokens = len(prompt_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, stop)
        self.eos_token_ids = eos_token_ids
        self.arrival = arrival  # time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.queue_time: float | None = None
        self.num_output_tokens = 0
        self.num_accepted_tokens = 0
        self.finish_reason: str | None = None
        self.error: StreamError | None = None
        self._tokens: list[int] = []  # not yet sent
        self._logprobs: list[TokenLogprob] = []
        self._closed = False  # the final message was handed out
        self._wakeup = asyncio.Event()

    @property
    def finished(self) -> bool:
        """No more deltas are wanted: the request finished, or failed."""
        return self.finish_reason is not None or self.error is not None

    def feed(self, delta: Delta) -> None:
        """Takes one step's delta (on the event loop, from the engine's reader)."""
        if self.finished:
            return
        now = time.monotonic()
        if delta.queue_time is not None:
            self.queue_time = delta.queue_time
        self.num_accepted_tokens = delta.num_accepted_tokens
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = now
        for i, token in enumerate(delta.token_ids):
            self._tokens.append(token)
            self.num_output_tokens += 1
            if delta.logprobs is not None:
                self._logprobs.append(delta.logprobs[i])
            if token not in self.eos_token_ids and self.detokenizer.add([token]) is not None:
                self._finish("stop", now)
                break
        else:
            if delta.finish_reason is not None:
                self._finish(delta.finish_reason, now)
        self._wakeup.set()

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        if not self.finished:
            self.error = StreamError(code, message)
            self.finished_at = time.monotonic()
            self._wakeup.set()

    def _finish(self, reason: str, now: float) -> None:
        self.finish_reason = reason
        self.finished_at = now

    async def next_response(self) -> pb.GenerateResponse | None:
        """Everything produced since the last call (waiting until there is some), ending with the
        message that carries finish_reason and usage; then None. Raises StreamError on failure."""
        while not (self._tokens or self.finished):
            self._wakeup.clear()
            await self._wakeup.wait()
        if self.error is not None:
            raise self.error
        if self._closed:
            return None
        response = pb.GenerateResponse(request_id=self.request_id, token_ids=self._tokens,
                                       text=self.detokenizer.take_delta(self.finished))
        response.logprobs.extend(_logprob_message(lp) for lp in self._logprobs)
        self._tokens, self._logprobs = [], []
        if self.finished:
            self._closed = True
            response.finish_reason = FINISH_REASONS[self.finish_reason]
            response.usage.prompt_tokens = self.num_prompt_tokens
            response.usage.completion_tokens = self.num_output_tokens
            # A stop string found here may cut tokens the engine already accepted as drafts.
            response.usage.spec_accepted_tokens = min(self.num_accepted_tokens, self.num_output_tokens)
            # cached_tokens stays 0: the engine has no prefix cache.
        return response


def _logprob_message(lp: TokenLogprob) -> pb.TokenLogprob:
    message = pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob)
    message.top.extend(pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top)
    return message
