"""Structured output with xgrammar: parse on submit, compile off the engine loop, masks per step.

A request's grammar is parsed when it is added (cheap; an invalid schema, regex or grammar is a
ValueError carrying xgrammar's message) and compiled against the tokenizer on a worker thread
(slow for big schemas; cached by source), so a slow grammar never stalls the engine loop: the
request simply waits until its grammar is ready. Each constrained request owns one
``GrammarMatcher``. Mask rows follow the step's logits-row order exactly; unconstrained rows are
all-allowed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

_KINDS = ("json_schema", "regex", "ebnf", "json_object")


def _xgr():
    """xgrammar, imported on first use: it imports transformers, seconds of start-up that an engine
    serving no structured output should not pay."""
    import xgrammar

    return xgrammar


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # one of _KINDS
    source: str  # schema JSON, regex or EBNF text ("" for json_object)

    def parse(self) -> xgr.Grammar:
        try:
            if self.kind == "json_schema":
                # Compact JSON: with free whitespace a weak model can emit blanks until max_tokens.
                return _strict_strings(_xgr().Grammar.from_json_schema(self.source, any_whitespace=False))
            if self.kind == "regex":
                return _xgr().Grammar.from_regex(self.source)
            if self.kind == "ebnf":
                return _xgr().Grammar.from_ebnf(self.source)
            return _xgr().Grammar.builtin_json_grammar()
        except RuntimeError as e:
            raise ValueError(f"invalid {self.kind}: {_strip_location(str(e))}") from None


def grammar_spec(json_schema: str | dict | None, regex: str | None, ebnf: str | None,
                 json_object: bool) -> GrammarSpec | None:
    """The one structured-output constraint of a request, or None; more than one is an error."""
    given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf))
             if value is not None}
    if json_object:
        given["json_object"] = ""
    if len(given) > 1:
        raise ValueError(f"at most one of {_KINDS} may be set, got {sorted(given)}")
    if not given:
        return None
    kind, value = next(iter(given.items()))
    if kind == "json_schema" and isinstance(value, dict):
        value = json.dumps(value)  # key order kept: it is the order properties are generated in
    elif kind == "json_schema" and isinstance(value, str):
        try:  # strictly: xgrammar's parser accepts trailing garbage after a valid prefix
            json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if kind != "json_object" and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
    return GrammarSpec(kind, value)


# xgrammar 0.2.8 writes the characters of length-bounded JSON strings as [^"\\\r\n], which lets raw
# control characters (invalid inside JSON strings) through; JSON's own class is [^"\\\0-\x1f].
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\"\\\0-\x1f]'


def _strict_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    text = str(grammar)
    return _xgr().Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS)) if _LOOSE_CHARS in text else grammar


def _strip_location(message: str) -> str:
    """xgrammar prefixes '[time] file.cc:line: '; keep what it says about the input."""
    head, sep, tail = message.partition(": ")
    return tail.strip() if sep and ".cc:" in head else message.strip()


class GrammarCompilerPool:
    """Compiles parsed grammars on worker threads; an LRU of futures shares identical sources."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2,
                 cache_size: int = 256) -> None:
        info = _xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = _xgr().GrammarCompiler(info, max_threads=max_threads)
        self.vocab_size = vocab_size
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encore-grammar")
        self.cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self.cache_size = cache_size

    def submit(self, spec: GrammarSpec) -> Future:
        grammar = spec.parse()  # raises ValueError now, on the caller's thread
        future = self.cache.get(spec)
        if future is None:
            future = self.pool.submit(self.compiler.compile_grammar, grammar)
            self.cache[spec] = future
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        self.cache.move_to_end(spec)
        return future

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class GrammarDeadEnd(Exception):
    """A request's grammar allows no next token, though it has not terminated."""


class RequestGrammar:
    """One constrained request: its compiled grammar (once ready) and matcher."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None

    def ready(self) -> bool:
        if self.matcher is None and self.future.done():
            self.matcher = _xgr().GrammarMatcher(self.future.result())
        return self.matcher is not None

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> int:
        """Fills rows ``row .. row + len(drafts)``: the mask before each draft, accepting it in
        turn, then rolls back. A draft the grammar rejects ends the walk: rows after it are left
        all-allowed (verification stops at the rejected draft, so they are never used). Returns
        the number of drafts the grammar accepted."""
        matcher = self.matcher
        accepted = 0
        for i in range(len(drafts) + 1):
            if matcher.is_terminated():
                break  # a draft ended the grammar: the request stops there, later rows are unused
            matcher.fill_next_token_bitmask(bitmask, row + i)
            if i == len(drafts) or not matcher.accept_token(drafts[i]):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return accepted

    def accept(self, tokens: list[int]) -> bool:
        """Advances over emitted tokens; True when the grammar has terminated. Raises GrammarDeadEnd
        where the grammar allowed no token at all (its row's logits were all masked)."""
        for t in tokens:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(t):
                if self._dead_end():
                    raise GrammarDeadEnd("the grammar allows no next token (it matches no text, or nothing "
                                         "that continues this one)")
                raise RuntimeError(f"token {t} was sampled against the grammar mask")
        return self.matcher.is_terminated()

    def _dead_end(self) -> bool:
        """Whether the matcher, not terminated, allows no next token: an empty language (``root ::=
        root``) or a prefix no token continues (a JSON string whose pattern no text matches)."""
        bitmask = allocate_bitmask(1, self.future.result().tokenizer_info.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        return not bool(bitmask.any())


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32, all bits set (every token allowed)."""
    return _xgr().allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets disallowed tokens' logits to -inf in place (bitmask already on logits' device)."""
    _xgr().apply_token_bitmask_inplace(logits, bitmask)


# A request's banned tokens and how many of its next positions may not take them (min_tokens).
Ban = tuple[tuple[int, ...], int]


def step_bitmask(groups: list[tuple[RequestGrammar | None, list[int], Ban | None]],
                 vocab_size: int) -> torch.Tensor | None:
    """The step's mask, one row per logits row in step-layout order: each group is a request's
    grammar (None: unconstrained, all allowed), the drafts its rows verify ([] for one row) and the
    tokens its first rows may not take (None: no ban). None when no row is constrained."""
    if all(g is None and ban is None for g, _, ban in groups):
        return None
    bitmask = allocate_bitmask(sum(len(d) + 1 for _, d, _ in groups), vocab_size)
    row = 0
    for grammar, drafts, ban in groups:
        if grammar is not None:
            grammar.fill(bitmask, row, drafts)
        if ban is not None:
            tokens, positions = ban
            for token in tokens:
                bit = 1 << (token % 32)
                keep = ~(bit - (bit >> 31 << 32))  # every bit but ``bit``, as an int32 value
                bitmask[row:row + min(positions, len(drafts) + 1), token // 32] &= keep
        row += len(drafts) + 1
    return bitmask
