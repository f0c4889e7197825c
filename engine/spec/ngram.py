"""N-gram prompt-lookup drafter: proposes the tokens that followed the latest earlier occurrence
of the sequence's last n tokens (n from ``max_n`` down to ``min_n``); no weights, host only."""

from __future__ import annotations

import numpy as np

from encore.engine.request import Request


class NgramDrafter:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, req: Request) -> list[int]:
        """Exactly k draft tokens (uniform verify rows need k); where the lookup finds fewer,
        the rest repeat the last proposed token and are simply rejected if wrong."""
        return self.lookup(req.token_ids)

    def lookup(self, token_ids: list[int]) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        draft: list[int] = []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                draft = tokens[start:start + self.k].tolist()
                break
        fill = draft[-1] if draft else int(tokens[-1])
        return draft + [fill] * (self.k - len(draft))
