"""Incremental detokenization with stop strings that may span token boundaries."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    Text is decoded over a short window of tokens (``prefix_offset``..end) and only the part past
    ``read_offset`` is new, so a token that completes a multi-byte character is not emitted half-way
    (an incomplete tail decodes to U+FFFD and is held back). While stop strings are set, the last
    ``max(len(stop)) - 1`` characters are held back from the stream too, because a stop string may
    still complete across the next token and they would then have to be taken back.

    Each new token costs two decodes. A transformers fast tokenizer's ``decode`` is its Rust
    backend's plus Python around it (~8.7 vs ~3.7 µs a window on encore-tiny's tokenizer): with 64
    streams that is ~0.6 ms a step, so the backend is called directly whenever ``decode`` would add
    nothing to it (no ``clean_up_tokenization_spaces``).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...]) -> None:
        self._decode = _window_decoder(tokenizer)  # None: no tokenizer, no text
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids = list(prompt_ids[-6:])  # a little prompt context so the first token decodes right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0

    def add(self, token_ids: list[int], match: bool = True) -> str | None:
        """Appends tokens; returns the stop string that ended the text, if one did. A stop string
        must end in the new text; with ``match`` False none is looked for (a request's first
        ``min_tokens``), and one completed then does not end a later call's text."""
        if self._decode is None:
            return None
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        old = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not match:
            return None
        for s in self.stop:
            at = self.text.find(s, max(0, old - len(s) + 1))  # the first match that ends past ``old``
            if at != -1:
                self.text = self.text[:at]
                return s
        return None

    def add_many(self, token_ids: list[int]) -> None:
        """The text of ``add`` called on each token in turn, without stop strings (it cannot return
        one), in two decodes where the tokens end on a whole character; else token by token, since
        the text then ends where the last whole character did."""
        if self._decode is None or not token_ids:
            return
        if self.stop:
            raise ValueError("add_many cannot tell which token completes a stop string; use add")
        start = len(self.ids)
        self.ids.extend(token_ids)
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd"):
            del self.ids[start:]
            for token in token_ids:
                self.add([token])
            return
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def take_delta(self, finished: bool) -> str:
        """The text not yet streamed, minus the held-back tail unless the request is finished."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta


def _window_decoder(tokenizer):
    """``ids -> text`` without special tokens: the Rust backend itself where that is the same decode."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
