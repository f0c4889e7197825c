"""A drafter that replays a known continuation with a chosen error rate (tests and benchmarks).

Given each request's true continuation (e.g. the target's own greedy output), it proposes the
next k true tokens, replacing each with a wrong one with probability ``error_rate`` (seeded per
request and position), so acceptance can be set to full (0), partial, or zero (1). Acceptance
measured with it is synthetic by construction.
"""

from __future__ import annotations

import random

from encore.engine.request import Request


class ReplayDrafter:
    def __init__(self, num_speculative_tokens: int, continuations: dict[str, list[int]], error_rate: float,
                 vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate!r}")
        self.k = num_speculative_tokens
        self.continuations = continuations
        self.error_rate = error_rate
        self.vocab_size = vocab_size
        self.seed = seed

    def propose(self, req: Request) -> list[int]:
        truth = self.continuations.get(req.request_id, [])
        start = req.num_output_tokens  # the draft after the last emitted token
        drafts = []
        for i in range(self.k):
            true = truth[start + i] if start + i < len(truth) else 0
            rng = random.Random(f"{self.seed}:{req.request_id}:{start + i}")
            if rng.random() < self.error_rate:
                true = (true + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
            drafts.append(true)
        return drafts
