"""Incremental detokenization with stop strings that may span token boundaries."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    Text is decoded over a short window of tokens (``prefix_offset``..end) and only the part past
    ``read_offset`` is new, so a token that completes a multi-byte character is not emitted half-way
    (an incomplete tail decodes to U+FFFD and is held back). While stop strings are set, the last
    ``max(len(stop)) - 1`` characters are held back from the stream too, because a stop string may
    still complete across the next token and they would then have to be taken back.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids = list(prompt_ids[-6:])  # a little prompt context so the first token decodes right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0

    def add(self, token_ids: list[int]) -> str | None:
        """Appends tokens; returns the stop string that ended the text, if one did."""
        if self.tokenizer is None:
            return None
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        start = max(0, len(self.text) - self.hold)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1:
                self.text = self.text[:at]
                return s
        return None

    def take_delta(self, finished: bool) -> str:
        """The text not yet streamed, minus the held-back tail unless the request is finished."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
