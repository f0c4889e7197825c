"""Incremental detokenization and stop strings across token boundaries, with a real BPE tokenizer."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from checkpoints import TOKENIZER_TEXT
from encore.engine import Engine, SamplingParams
from encore.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(v3_dir):
    return AutoTokenizer.from_pretrained(v3_dir)


def stream(tokenizer, ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, [], stop)
    pieces, hit = [], None
    for t in ids:
        hit = detok.add([t])
        pieces.append(detok.take_delta(hit is not None))
        if hit:
            break
    if hit is None:
        pieces.append(detok.take_delta(True))
    return "".join(pieces), hit, detok


def test_incremental_text_equals_full_decode_including_multibyte_characters(tokenizer):
    text = "Ünïcödé — 日本語 text, emoji 🙂. def fibonacci(n):"
    ids = tokenizer.encode(text)
    # Byte-level BPE splits the multi-byte characters over several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    streamed, _, _ = stream(tokenizer, ids)
    assert streamed == tokenizer.decode(ids) == text


def test_stop_string_spanning_tokens_truncates_and_is_never_streamed(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    stop = "fox jum"
    pieces_seen = []
    detok = IncrementalDetokenizer(tokenizer, [], (stop,))
    for t in ids:
        hit = detok.add([t])
        pieces_seen.append(detok.take_delta(hit is not None))
        if hit:
            break
    assert hit == stop
    assert "".join(pieces_seen) == "The quick brown "
    assert not any("fox" in p for p in pieces_seen)


def test_a_stop_string_completed_while_not_matching_ends_nothing_later(tokenizer):
    """``add(..., match=False)`` (a request's first min_tokens) looks for no stop string, and one completed
    then is not found by a later call: a stop string must end in that call's new text. With stops of
    different lengths the held-back tail covers the short one's old match."""
    ids = tokenizer.encode("ab fox cd fox ef")
    detok = IncrementalDetokenizer(tokenizer, [], ("fox", "a long stop"))
    first = next(i for i in range(1, len(ids) + 1) if "fox" in tokenizer.decode(ids[:i]))
    assert all(detok.add([t], match=False) is None for t in ids[:first])
    second, hit = next((i, hit) for i in range(first, len(ids)) if (hit := detok.add([ids[i]])) is not None)
    assert hit == "fox" and "fox" in tokenizer.decode(ids[first:second + 1])
    assert detok.text == "ab fox cd "


def test_engine_stop_strings_and_stop_token_ids(v3_dir, tokenizer):
    engine = Engine(str(v3_dir), device="cpu", page_size=4)
    free = engine.generate(["def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0.0,
                                                                 ignore_eos=True))[0]
    assert len(free.token_ids) == 16
    # Stop on a string taken from the middle of the free-running text: it must end exactly before it.
    cut = free.text[3:7]
    assert cut
    stopped = engine.generate(["def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0.0,
                                                                    ignore_eos=True, stop=[cut]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:free.text.index(cut)]
    token = free.token_ids[5]
    by_id = engine.generate(["def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                                  stop_token_ids=[token]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[:free.token_ids.index(token) + 1]


def test_corpus_round_trip(tokenizer):
    sample = TOKENIZER_TEXT[:300]
    assert stream(tokenizer, tokenizer.encode(sample))[0] == sample


@pytest.mark.parametrize("clean_up", [False, True])
def test_streamed_text_follows_the_tokenizers_clean_up_setting(tokenizer, clean_up, monkeypatch):
    """The Rust backend is decoded directly only while ``clean_up_tokenization_spaces`` is off (the
    clean-up is the tokenizer's Python, which transformers skips for BPE models anyway); either way
    the stream is the tokenizer's own decode, spaces before punctuation included."""
    text = "Hello , world ! It 's a test : do n't stop ."
    ids = tokenizer.encode(text)
    want = tokenizer.decode(ids, skip_special_tokens=True)
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", clean_up)
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **kw: calls.append(a) or decode(*a, **kw))
    assert stream(tokenizer, ids)[0] == want == text
    assert bool(calls) is clean_up  # the tokenizer's own decode only where it may differ from the backend's


@pytest.mark.parametrize("seed", range(4))
def test_add_many_gives_the_text_of_adding_token_by_token(tokenizer, seed):
    """Multi-byte characters split over tokens, and random ids (byte junk, split characters that
    never complete), added in random chunks: the text is the one-token-at-a-time text at each chunk's end."""
    rng = random.Random(seed)
    ids = tokenizer.encode("Ünïcödé — 日本語 text, emoji 🙂. def fibonacci(n):") + [
        rng.randrange(tokenizer.vocab_size) for _ in range(80)]
    one, many = IncrementalDetokenizer(tokenizer, [5, 6], ()), IncrementalDetokenizer(tokenizer, [5, 6], ())
    start = 0
    while start < len(ids):
        end = min(len(ids), start + rng.randint(1, 6))
        for t in ids[start:end]:
            one.add([t])
        many.add_many(ids[start:end])
        assert many.text == one.text
        start = end


def test_add_many_refuses_stop_strings(tokenizer):
    with pytest.raises(ValueError, match="stop string"):
        IncrementalDetokenizer(tokenizer, [], ("x",)).add_many([5])


def test_engine_text_of_verify_steps_is_the_decode_of_their_tokens(v3_dir, tokenizer):
    """A verify step commits several tokens of a row at once, decoded in one go where no stop string is
    set: the streamed deltas and the final text are the tokenizer's decode of the tokens, and the same
    as without speculation (n-gram drafts on a repetitive prompt, so steps accept several)."""
    prompt = "a b c d a b c d a b c d a b c d a b"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    texts = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        engine = Engine(str(v3_dir), device="cpu", page_size=4, speculative=spec)
        engine.add_request("r", prompt, params)
        deltas, counts, out = [], [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                deltas.append(out.new_text)
                counts.append(len(out.new_token_ids))
        assert out.finished and "".join(deltas) == out.text
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        texts[spec is None] = out.text
        if spec is not None:
            assert max(counts) > 1  # some step committed several tokens
    assert texts[True] == texts[False]
