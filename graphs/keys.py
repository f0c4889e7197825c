"""Graph keys: the step shapes that get a compiled graph (and, on CUDA, a captured one).

``GraphKey(num_extends, q_len_per_req, bs, num_tokens)`` — DESIGN.md "One step, end to end", step 3.
A key's prefill rows are padded up to ``num_extends`` (a padded row is a one-token prompt on the dummy
page, graphs/padding.py); its prefill tokens are a padded bucket, ``num_tokens - num_decodes *
q_len_per_req`` of them, which holds the real prefill tokens and one per padded prefill row; its
decode rows are padded up to ``bs - num_extends``. A step runs on the smallest key of its own mode
that holds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from encore.backends.metadata import ForwardBatch, StepShape

if TYPE_CHECKING:
    from encore.engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class GraphKey(StepShape):
    num_extends: int
    q_len_per_req: int
    bs: int
    num_tokens: int

    def __post_init__(self) -> None:
        if not 0 <= self.num_extends <= self.bs or self.bs < 1:
            raise ValueError(f"GraphKey needs 0 <= num_extends <= bs and bs >= 1, got {self}")
        if self.q_len_per_req < 1:
            raise ValueError(f"GraphKey q_len_per_req must be >= 1, got {self}")
        if self.num_extend_tokens < self.num_extends:
            raise ValueError(f"GraphKey {self} leaves {self.num_extend_tokens} prefill tokens for "
                             f"{self.num_extends} prefill rows (each needs at least one)")

    def holds(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` can run on this key once padded: same mode and decode q_len, no more
        prefill rows, decode rows or prefill tokens (a token per padded prefill row included) than the
        key has."""
        if batch.mode is not self.mode or batch.num_extends > self.num_extends:
            return False
        if self.num_decodes and batch.q_len_per_req != self.q_len_per_req:
            return False
        pad_extends = self.num_extends - batch.num_extends
        return (batch.num_decodes <= self.num_decodes
                and batch.num_extend_tokens + pad_extends <= self.num_extend_tokens)

    def __str__(self) -> str:
        return (f"{self.mode.value}(extends={self.num_extends}, q_len={self.q_len_per_req}, "
                f"bs={self.bs}, tokens={self.num_tokens})")


def build_keys(decode_sizes: Iterable[int], q_lens: Iterable[int], mixed_extends: Iterable[int],
               mixed_decode_sizes: Iterable[int], prefill_tokens: Iterable[int], extend_sizes: Iterable[int],
               max_tokens: int, max_rows: int) -> tuple[GraphKey, ...]:
    """Every key of the configured buckets that fits the step budget, largest first.

    DECODE: ``d`` rows of ``q`` tokens for d in decode_sizes, q in q_lens.
    MIXED: ``e`` prefill rows with a ``p``-token bucket plus ``d`` decode rows of ``q`` tokens.
    EXTEND: ``e`` prefill rows with a ``p``-token bucket.
    No step has more than ``max_rows`` rows, so a DECODE key's rows are capped at ``max_rows``, an
    EXTEND key's prefill rows too, and a MIXED key's prefill rows and decode rows each at
    ``max_rows - 1``, the most a step with both can have: the largest MIXED bucket of ``e`` prefill
    rows holds every MIXED step of at most ``e`` prefill rows whose tokens fit, its padded rows taking
    it past ``max_rows`` where the step has fewer prefill rows (a step of 4 prefill rows and 60 decode
    rows under a 64-row budget runs on (16, 63)). So a burst of as many arrivals as the budget allows
    joins a step on a key whatever the budget. A key over ``max_tokens`` tokens is dropped.
    """
    keys = set()
    q_lens = tuple(q_lens)
    mixed_rows = {min(e, max_rows - 1) for e in mixed_extends} if max_rows > 1 else set()
    mixed_decodes = {min(d, max_rows - 1) for d in mixed_decode_sizes}
    extend_rows = {min(e, max_rows) for e in extend_sizes}
    for q in q_lens:
        keys.update(GraphKey(0, q, min(d, max_rows), min(d, max_rows) * q) for d in decode_sizes)
        keys.update(GraphKey(e, q, e + d, p + d * q) for e in mixed_rows for d in mixed_decodes
                    for p in prefill_tokens if e <= p)
    keys.update(GraphKey(e, 1, e, p) for e in extend_rows for p in prefill_tokens if e <= p)
    fitting = (k for k in keys if k.num_tokens <= max_tokens)
    return tuple(sorted(fitting, key=lambda k: (k.num_tokens, k.bs, k.num_extends, k.q_len_per_req), reverse=True))


def keys_for(config: EngineConfig) -> tuple[GraphKey, ...]:
    """An engine configuration's keys: its buckets, with decode q_len 1 + k added when speculative
    decoding is on (its verify steps are decode rows of 1 + k tokens)."""
    q_lens = set(config.graph_q_lens)
    if config.speculative is not None:
        q_lens.add(1 + config.speculative.num_speculative_tokens)
    return build_keys(config.graph_decode_sizes, sorted(q_lens), config.graph_mixed_extends,
                      config.graph_mixed_decode_sizes, config.graph_prefill_tokens, config.graph_extend_sizes,
                      config.max_num_batched_tokens, config.max_num_seqs)


class KeyTable:
    """Finds the smallest key that holds a step (fewest tokens, then fewest rows)."""

    def __init__(self, keys: Iterable[GraphKey]) -> None:
        self.keys = tuple(sorted(set(keys), key=lambda k: (k.num_tokens, k.bs)))

    def find(self, batch: ForwardBatch) -> GraphKey | None:
        return next((k for k in self.keys if k.holds(batch)), None)
