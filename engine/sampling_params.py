"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from encore.engine.grammar import GrammarSpec, grammar_spec

_MAX_LOGPROBS = 20
# The sampler divides logits by temperature and repetition_penalty in float32: past these bounds a
# quotient overflows (or the value itself rounds to 0 or inf) and a row's probabilities become NaN,
# which samples token 0 whatever its grammar or min_tokens mask allows.
_MIN_DIVISOR, _MAX_DIVISOR = 1e-6, 1e6


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` is greedy; a positive one, like ``repetition_penalty``, is in [1e-6, 1e6]
    (the sampler divides float32 logits by it). ``top_k == 0`` and ``top_p == 1`` disable those filters,
    ``min_p == 0`` disables min-p. Penalties follow vLLM's definitions: ``repetition_penalty``
    divides positive (multiplies negative) logits of every token seen in the prompt or output;
    ``presence_penalty`` / ``frequency_penalty`` subtract from tokens seen in the output.
    ``seed`` makes the request's tokens independent of whatever else shares its batch.
    ``logprobs`` asks for the sampled token's logprob plus the top-``logprobs`` alternatives
    (``None``: no logprobs); logprobs are those of the model's raw distribution.
    Structured output: at most one of ``json_schema`` (JSON text or a dict), ``regex``, ``ebnf``
    (grammar text) or ``json_object``; the grammar itself is checked when the request is added.
    ``speculative``: False opts this request out of the engine's speculative decoding (its rows
    keep the batch's uniform shape but accept no draft: its tokens are exactly the plain-decode
    ones); True asks for it and is refused by an engine started without it; None follows the engine.
    ``min_tokens``: the request's first ``min_tokens`` tokens are not EOS (unless ``ignore_eos``: then
    EOS does not end it anyway; vLLM bans it regardless) nor ``stop_token_ids`` (their logits are
    masked), and a stop string completed within them does not end it (vLLM's definition); it cannot
    exceed ``max_tokens``, nor combine with structured output, whose grammar may allow nothing but a
    stop token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_object: bool = False
    speculative: bool | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and (self.temperature == 0.0
                                                 or _MIN_DIVISOR <= self.temperature <= _MAX_DIVISOR),
               f"temperature must be 0 (greedy) or in [{_MIN_DIVISOR:g}, {_MAX_DIVISOR:g}], got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and 0 <= self.top_k < 2**31,
               f"top_k must be an integer in [0, 2**31) (0 disables it), got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(_is_number(self.repetition_penalty) and _MIN_DIVISOR <= self.repetition_penalty <= _MAX_DIVISOR,
               f"repetition_penalty must be in [{_MIN_DIVISOR:g}, {_MAX_DIVISOR:g}] (1 is off), "
               f"got {self.repetition_penalty!r}")
        _check(_is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        _check(_is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _check(isinstance(self.json_object, bool), f"json_object must be True or False, got {self.json_object!r}")
        grammar_spec(self.json_schema, self.regex, self.ebnf, self.json_object)
        _check(self.speculative is None or isinstance(self.speculative, bool),
               f"speculative must be True, False or None, got {self.speculative!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(not self.min_tokens or self.grammar is None,
               f"min_tokens={self.min_tokens} cannot be combined with structured output: its grammar may "
               "allow nothing but a stop token")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= _MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {_MAX_LOGPROBS}] or None, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def grammar(self) -> GrammarSpec | None:
        return grammar_spec(self.json_schema, self.regex, self.ebnf, self.json_object)

    @property
    def bans_stop_tokens(self) -> bool:
        """Whether ``min_tokens`` masks tokens: it is set and there is a stop token to ban."""
        return self.min_tokens > 0 and (not self.ignore_eos or bool(self.stop_token_ids))

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p drops tokens from a stochastic row's distribution."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


def _is_int(value) -> bool:
    """An integer, not a bool (``True`` would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A real number (not a bool, nor None or a string, which would fail the range checks' comparisons)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
