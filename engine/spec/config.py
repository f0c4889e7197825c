"""SpecConfig: which drafter speculative decoding uses, and how many tokens it drafts."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

METHODS = ("mtp", "eagle3", "ngram", "replay")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """``method``: "mtp" (the checkpoint's nextn layer), "eagle3" (an EAGLE-3 draft model fed the
    target's auxiliary hidden states; ``draft_model`` is its HF checkpoint directory, architecture
    LlamaForCausalLMEagle3), "ngram" (prompt lookup) or "replay" (a known continuation with
    ``error_rate`` wrong drafts: synthetic acceptance for tests and benchmarks).
    ``num_speculative_tokens`` is k. ``draft_model`` is required for "eagle3" and only for it."""

    method: str
    num_speculative_tokens: int
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    continuations: dict | None = None
    error_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 8:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 8], got {self.num_speculative_tokens!r}")
        if self.method == "eagle3" and not self.draft_model:
            raise ValueError("speculative method 'eagle3' needs draft_model: the directory of an EAGLE-3 "
                             "checkpoint (LlamaForCausalLMEagle3)")
        if self.method != "eagle3" and self.draft_model is not None:
            raise ValueError(f"draft_model is only for 'eagle3', got it with {self.method!r}; "
                             "'mtp' uses the checkpoint's own nextn layer")

    @staticmethod
    def from_dict(raw: dict) -> SpecConfig:
        unknown = set(raw) - set(SpecConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative options {sorted(unknown)}; "
                             f"allowed: {sorted(SpecConfig.__dataclass_fields__)}")
        required = [f.name for f in fields(SpecConfig) if f.default is MISSING]
        missing = [name for name in required if name not in raw]
        if missing:
            raise ValueError(f"speculative options {raw!r} lack {missing}: {' and '.join(required)} are required")
        return SpecConfig(**raw)
