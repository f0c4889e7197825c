"""RequestStream (fed deltas -> response messages, detokenized and cut at stop strings as the engine
would) and SendPacer (a bounded number of messages per round of the event loop)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from encore.engine.detokenizer import IncrementalDetokenizer
from encore.engine.tokenizer import load_tokenizer
from encore.models.tiny import default_model_dir
from encore.server.messages import Delta
from encore.server.request_stream import RequestStream, SendPacer

PROMPT_TEXT = "def fibonacci(n):"
OUTPUT_TEXT = "\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_dir())


def stream_for(tokenizer, prompt, stop=(), eos=frozenset()):
    return RequestStream("r", prompt, stop, tokenizer, eos, arrival=0.0, pacer=SendPacer(1))


def engine_text(tokenizer, prompt, tokens, stop=()) -> tuple[list[int], str]:
    """What the engine's own detokenization keeps: tokens fed one at a time up to a stop string."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    kept = []
    for token in tokens:
        kept.append(token)
        if detok.add([token]) is not None:
            break
    return kept, detok.text


def drain(stream, chunks, finish_reason="length") -> tuple[list[int], str, list]:
    """Feeds ``chunks`` as deltas, taking one message after each; returns tokens, text, messages."""
    messages = []
    for i, chunk in enumerate(chunks):
        stream.feed(Delta("r", chunk, None, finish_reason if i == len(chunks) - 1 else None))
        response = stream.take_response()
        if response is not None:
            messages.append(response)
    assert stream.take_response() is None  # the final message was handed out
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages), messages


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_merged_deltas_are_detokenized_as_the_engine_does_token_by_token(tokenizer, chunk):
    prompt, tokens = tokenizer.encode(PROMPT_TEXT), tokenizer.encode(OUTPUT_TEXT)
    chunks = [tokens[i:i + chunk] for i in range(0, len(tokens), chunk)]
    got_tokens, got_text, messages = drain(stream_for(tokenizer, prompt), chunks)
    assert (got_tokens, got_text) == (tokens, engine_text(tokenizer, prompt, tokens)[1])
    assert messages[-1].finish_reason and messages[-1].usage.completion_tokens == len(tokens)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("engine_finishes", [False, True])
def test_a_stop_string_inside_a_merged_delta_ends_the_stream_at_its_token(tokenizer, chunk, engine_finishes):
    prompt, tokens = tokenizer.encode(PROMPT_TEXT), tokenizer.encode(OUTPUT_TEXT)
    stop = "return fib"
    want_tokens, want_text = engine_text(tokenizer, prompt, tokens, (stop,))
    assert len(want_tokens) < len(tokens) and stop not in want_text
    stream = stream_for(tokenizer, prompt, (stop,))
    chunks = [tokens[i:i + chunk] for i in range(0, len(tokens), chunk)]
    if not engine_finishes:  # the engine is still running the request when the stop string shows
        chunks = [c for c in chunks if sum(map(len, chunks[:chunks.index(c)])) < len(want_tokens)]
    got_tokens, got_text, messages = drain(stream, chunks, "length" if engine_finishes else None)
    assert (got_tokens, got_text) == (want_tokens, want_text)
    assert stream.finish_reason == "stop" and messages[-1].usage.completion_tokens == len(want_tokens)
    # Only a request the engine still runs must be aborted there.
    assert stream.stopped_early == (not engine_finishes or len(chunks) > 1 and chunk < len(tokens)
                                    and sum(map(len, chunks[:-1])) >= len(want_tokens))


def test_eos_is_kept_as_a_token_but_not_detokenized(tokenizer):
    prompt, tokens = tokenizer.encode(PROMPT_TEXT), tokenizer.encode(OUTPUT_TEXT)[:6]
    eos = tokenizer.eos_token_id
    got_tokens, got_text, _ = drain(stream_for(tokenizer, prompt, eos=frozenset({eos})), [tokens[:3], tokens[3:] + [eos]],
                                    "stop")
    assert got_tokens == tokens + [eos]
    assert got_text == engine_text(tokenizer, prompt, tokens)[1]


def run_pacer(per_round: int, callers: int, cancel: set[int] = frozenset()) -> list[tuple[int, int]]:
    """(round, caller) of each turn granted, with a ticker counting the event loop's rounds."""

    async def main():
        loop = asyncio.get_running_loop()
        pacer = SendPacer(per_round)
        rounds = 0
        ticking = True

        def tick():
            nonlocal rounds
            rounds += 1
            if ticking:
                loop.call_soon(tick)

        loop.call_soon(tick)
        granted = []

        async def one(i):
            waiter = loop.create_future()

            def grant() -> bool:  # as a stream's: refused once its call has ended (here: cancelled)
                if waiter.done():
                    return False
                waiter.set_result(None)
                return True

            pacer.request(grant)
            await waiter
            granted.append((rounds, i))

        tasks = [asyncio.ensure_future(one(i)) for i in range(callers)]
        await asyncio.sleep(0)  # every caller has asked for its turn
        for i in cancel:
            tasks[i].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ticking = False
        return granted

    return asyncio.run(main())


def test_the_pacer_grants_at_most_per_round_turns_a_round_in_arrival_order():
    granted = run_pacer(per_round=2, callers=9)
    assert [i for _, i in granted] == list(range(9))
    per_round = Counter(r for r, _ in granted)
    assert max(per_round.values()) == 2 and len(per_round) == 5


def test_a_cancelled_waiter_does_not_use_up_a_turn():
    granted = run_pacer(per_round=1, callers=4, cancel={2})
    assert [i for _, i in granted] == [0, 1, 3]
    rounds = [r for r, _ in granted]
    # One turn a round: caller 3 comes the round after caller 1, as it would had caller 2 not been there.
    assert rounds[2] - rounds[1] == 1
    plain = [r for r, _ in run_pacer(per_round=1, callers=3)]
    assert plain[2] - plain[1] == 1


def test_fed_streams_are_woken_a_few_a_round_and_a_gone_one_takes_no_turn(tokenizer):
    """Streams waiting for tokens are woken by the pacer, ``per_round`` a round, in the order they
    were fed; one whose call ended while it waited is skipped."""

    async def main():
        loop = asyncio.get_running_loop()
        pacer = SendPacer(2)
        streams = [RequestStream(f"r{i}", [5], (), tokenizer, frozenset(), arrival=0.0, pacer=pacer)
                   for i in range(7)]
        rounds, woken = 0, []

        def tick():
            nonlocal rounds
            rounds += 1
            loop.call_soon(tick)

        async def one(i):
            await streams[i].next_turn()
            woken.append((rounds, i))

        tasks = [asyncio.ensure_future(one(i)) for i in range(7)]
        await asyncio.sleep(0)  # all waiting for tokens
        loop.call_soon(tick)
        tasks[3].cancel()
        await asyncio.sleep(0)
        for i in (6, 5, 4, 3, 2, 1, 0):
            streams[i].feed(Delta(f"r{i}", [7], None, None))
        await asyncio.gather(*tasks, return_exceptions=True)
        return woken

    woken = asyncio.run(main())
    assert [i for _, i in woken] == [6, 5, 4, 2, 1, 0]
    per_round = Counter(r for r, _ in woken)
    assert max(per_round.values()) == 2 and len(per_round) == 3
