"""A request's life in the engine, and what the engine reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from encore.engine.detokenizer import IncrementalDetokenizer
from encore.engine.grammar import RequestGrammar
from encore.engine.sampling_params import SamplingParams


PENDING = -1  # in ``Request.token_ids``: a token sampled by the step in flight, not read yet


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True)
class Request:
    """``token_ids`` is prompt + output; ``num_computed`` of them have their KV in the cache (or will
    have, once the step in flight has run). ``draft_token_ids`` are speculative tokens proposed for
    the next verify step (not yet output).

    Overlapped steps (engine.py): a token sampled by a step still on the device is held in
    ``token_ids`` by ``PENDING`` until it is read; ``num_pending`` counts those placeholders (always the
    last entries), ``pending_row`` is the logits row of the newest one in its step, and
    ``final_pending`` says that it is the request's last token by length, so it needs no next step."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    grammar: RequestGrammar | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held when it was first admitted
    num_pending: int = 0
    pending_row: int = -1
    final_pending: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_banned_positions(self) -> int:
        """How many of the next tokens may not be a stop token: those short of ``min_tokens`` where it
        bans any (``SamplingParams.bans_stop_tokens``), else 0."""
        if not self.params.bans_stop_tokens:  # first: every row of every masked step asks
            return 0
        return max(0, self.params.min_tokens - self.num_output_tokens)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Decode rows feed exactly their last sampled token; anything else is a prefill row
        (a new prompt, a later chunk of it, or a preempted request recomputing its KV)."""
        return self.num_output_tokens > 0 and self.num_uncomputed == 1

    @property
    def num_committed(self) -> int:
        """Tokens known on the host: ``token_ids`` without the pending placeholders."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_computed_known(self) -> int:
        """Computed tokens whose ids are known on the host (what the prefix cache may key pages by)."""
        return min(self.num_computed, self.num_committed)

    def drop_pending(self) -> None:
        """Drops the placeholders: the request ended before the step in flight gave their tokens."""
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

    @property
    def ready(self) -> bool:
        """False while its grammar is still compiling, or (preempted) while a step in flight has yet
        to give it its last token: it is not admitted before."""
        return not self.num_pending and (self.grammar is None or self.grammar.ready())

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: cumulative ``token_ids``/``text`` plus this step's deltas.

    ``token_ids`` is sliced from the request's own token list when read (``sequence``, prompt then
    output, which only ever grows), as it stood after this step: copying it into every step's output
    cost O(output length) per request per step, while streaming callers read only the deltas."""

    request_id: str
    prompt_token_ids: list[int]
    sequence: list[int] = field(repr=False)  # the request's prompt + output ids; later steps append to it
    num_output_tokens: int
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None
    num_draft_tokens: int = 0  # speculative tokens drafted for this request so far
    num_accepted_tokens: int = 0  # of which the target accepted
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (Request.num_cached_tokens)

    @property
    def token_ids(self) -> list[int]:
        start = len(self.prompt_token_ids)
        return self.sequence[start:start + self.num_output_tokens]
