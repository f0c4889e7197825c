"""SpecConfig: which drafter speculative decoding uses, and how many tokens it drafts."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("mtp", "ngram", "replay")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """``method``: "mtp" (the checkpoint's nextn layer), "ngram" (prompt lookup) or "replay"
    (a known continuation with ``error_rate`` wrong drafts: synthetic acceptance for tests and
    benchmarks). ``num_speculative_tokens`` is k."""

    method: str
    num_speculative_tokens: int
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    continuations: dict | None = None
    error_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.method == "eagle3":
            raise ValueError("speculative method 'eagle3' is not implemented yet; use 'mtp' or 'ngram'")
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 8:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 8], got {self.num_speculative_tokens!r}")
        if self.draft_model is not None:
            raise ValueError("draft_model is only for 'eagle3'; 'mtp' uses the checkpoint's own nextn layer")

    @staticmethod
    def from_dict(raw: dict) -> SpecConfig:
        unknown = set(raw) - set(SpecConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative options {sorted(unknown)}; "
                             f"allowed: {sorted(SpecConfig.__dataclass_fields__)}")
        return SpecConfig(**raw)
