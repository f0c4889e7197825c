"""One Generate call as the server process sees it: engine deltas in, response messages out.

Detokenization lives here, in the server process, and so does stop-string matching, because a stop
string is a property of the text. The engine process only sees token ids (it stops by itself on EOS,
stop token ids and length). When the text completes a stop string the stream finishes at the token
that completed it — the same tokens and text ``Engine.generate`` returns, since this reuses the
engine's ``IncrementalDetokenizer`` and feeds it tokens one at a time exactly as the engine does —
and the handler tells the engine process, which may already be a step further, to abort the request.

Feeding a step's delta only queues its tokens: they are detokenized when the handler takes them
into a message (``take_response``), all of a message's tokens at once where no stop string is set
(``IncrementalDetokenizer.add_many``). Every engine step feeds every stream on the event loop, in one
callback, so decoding each token there (~1.2 ms a step for 64 streams on the 2-core CPU machine, by
cProfile) held back everything else on the loop, new calls included; and tokens that wait for a busy
loop are merged into one message, whose decode then covers them all. Deltas that arrive while the
handler is still sending are merged the same way, so a slow client gets fewer, larger messages rather
than a growing backlog of tiny ones.

``SendPacer`` bounds how many streams build and send a message in one round of the event loop (see
there).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

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
                 eos_token_ids: frozenset[int], arrival: float, pacer: SendPacer, min_tokens: int = 0) -> None:
        """``min_tokens``: a stop string completed by one of the first that many tokens does not end it."""
        self.request_id = request_id
        self.min_tokens = min_tokens
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
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: StreamError | None = None
        self.stopped_early = False  # a stop string ended it while the engine still runs it
        self._fed: list[int] = []  # fed, not yet taken into a message
        self._fed_logprobs: list[TokenLogprob] = []
        self._engine_finish: str | None = None  # the engine's finish reason, fed, not yet taken
        self._fed_at = arrival
        self._closed = False  # the final message was handed out
        self._pacer = pacer
        self._waiting = False  # in next_turn, for tokens
        self._queued = False  # asked the pacer for a turn, not granted yet
        self._wakeup = asyncio.Event()

    @property
    def finished(self) -> bool:
        """The stream has its last tokens: the request finished (as taken into a message), or failed."""
        return self.finish_reason is not None or self.error is not None

    def feed(self, delta: Delta) -> None:
        """Queues one step's delta (on the event loop, from the engine's reader)."""
        if self.finished or self._engine_finish is not None:
            return
        self._fed_at = now = time.monotonic()
        if delta.queue_time is not None:
            self.queue_time = delta.queue_time
        self.num_accepted_tokens = delta.num_accepted_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self._fed += delta.token_ids
        if delta.logprobs is not None:
            self._fed_logprobs += delta.logprobs
        self._engine_finish = delta.finish_reason
        if self._waiting:
            self._ask_turn()

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        if not self.finished:
            self.error = StreamError(code, message)
            self.finished_at = time.monotonic()
            self._wakeup.set()

    async def next_turn(self) -> None:
        """Returns once there is something to take (tokens, the end, a failure) and this stream may
        send it: its turn from the pacer, or at once where there is nothing more to send."""
        if self._closed or self.error is not None:
            return
        self._wakeup.clear()
        self._waiting = True
        if self._fed or self._engine_finish is not None or self.finished:
            self._ask_turn()  # else the next feed asks
        try:
            await self._wakeup.wait()  # set by _grant, or by fail
        finally:
            self._waiting = False

    def _ask_turn(self) -> None:
        if not self._queued:
            self._queued = True
            self._pacer.request(self._grant)

    def _grant(self) -> bool:
        """The pacer's turn for this stream; False (the turn goes to the next) if it stopped waiting."""
        self._queued = False
        if not self._waiting:
            return False
        self._waiting = False
        self._wakeup.set()
        return True

    def take_response(self) -> pb.GenerateResponse | None:
        """Everything fed since the last call as one message, the last one carrying finish_reason
        and usage; then None. Raises StreamError on failure."""
        if self.error is not None:
            raise self.error
        if self._closed:
            return None
        tokens, logprobs = self._take_fed()
        response = pb.GenerateResponse(request_id=self.request_id, token_ids=tokens,
                                       text=self.detokenizer.take_delta(self.finished))
        response.logprobs.extend(_logprob_message(lp) for lp in logprobs)
        if self.finished:
            self._closed = True
            response.finish_reason = FINISH_REASONS[self.finish_reason]
            response.usage.prompt_tokens = self.num_prompt_tokens
            response.usage.completion_tokens = self.num_output_tokens
            # A stop string found here may cut tokens the engine already accepted as drafts.
            response.usage.spec_accepted_tokens = min(self.num_accepted_tokens, self.num_output_tokens)
            response.usage.cached_tokens = self.num_cached_tokens
        return response

    def _take_fed(self) -> tuple[list[int], list[TokenLogprob]]:
        """Detokenizes the fed tokens, ending the stream at the first that completes a stop string,
        else where the engine ended it; returns the tokens (and logprobs) the stream keeps."""
        tokens, logprobs = self._fed, self._fed_logprobs
        self._fed, self._fed_logprobs = [], []
        reason = self._engine_finish
        eos = self.eos_token_ids
        if self.detokenizer.stop:  # token by token, to end at the one that completes a stop string
            for i, token in enumerate(tokens):
                match = self.num_output_tokens + i + 1 > self.min_tokens  # past min_tokens: a stop string ends it
                if token not in eos and self.detokenizer.add([token], match) is not None:
                    del tokens[i + 1:], logprobs[i + 1:]
                    self.stopped_early = reason is None
                    reason = "stop"
                    break
        else:
            self.detokenizer.add_many([token for token in tokens if token not in eos])
        self.num_output_tokens += len(tokens)
        if reason is not None:
            self.finish_reason = reason
            self.finished_at = self._fed_at
        return tokens, logprobs


def _logprob_message(lp: TokenLogprob) -> pb.TokenLogprob:
    message = pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob)
    message.top.extend(pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top)
    return message


class SendPacer:
    """Lets at most ``per_round`` streams take and send a message per round of the event loop.

    gRPC's aio server accepts calls one at a time, each acceptance a callback that waits its turn on
    the event loop behind everything else ready to run. A step's deltas woke every stream at once, and
    each message costs its stream ~50-100 µs of loop time (building it, gRPC's send): with 64 streams
    the loop ran rounds of several milliseconds, one new call admitted per round, and a burst of 64
    calls reached the engine over 150-210 ms (H100 host, an engine stepping every 1.3 ms without a
    model; a bare grpc.aio server under the same message load admitted them in ~35 ms). Now a feed
    only queues its stream here, and each round wakes the next ``per_round`` of them: a new call waits
    behind a few messages, not all of them, and the streams held back merge their tokens into fewer
    messages. With this and the deferred detokenization the same burst arrived over 51-85 ms, and in
    ``bench_server_frontend.py`` (same host) the streams' throughput rose from 14.3 k to 19.6-24.9 k
    tokens/s against a bare server's 28-32 k. Nothing is held across a send, so a slow client delays
    only its own stream.
    """

    def __init__(self, per_round: int) -> None:
        self.per_round = per_round
        self._left = per_round  # turns left in this round
        self._queue: deque[Callable[[], bool]] = deque()
        self._refill_scheduled = False

    def request(self, grant: Callable[[], bool]) -> None:
        """Calls ``grant`` when a turn is free (at once if one is); it returns whether it took the
        turn (False: its caller no longer wants it, and the turn goes to the next)."""
        self._schedule_refill()
        if self._left and not self._queue:
            if grant():
                self._left -= 1
        else:
            self._queue.append(grant)

    def _schedule_refill(self) -> None:
        # call_soon: the refill runs after everything already queued, i.e. once per round.
        if not self._refill_scheduled:
            self._refill_scheduled = True
            asyncio.get_running_loop().call_soon(self._refill)

    def _refill(self) -> None:
        self._refill_scheduled = False
        self._left = self.per_round
        while self._left and self._queue:
            if self._queue.popleft()():
                self._left -= 1
        if self._queue:
            self._schedule_refill()
