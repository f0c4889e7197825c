"""Model drafters: the MTP layer and the EAGLE-3 draft model behind one interface.

The speculator drives both the same way (speculator.py): ``first_pass`` over the step's own layout
right after the target forward (prefill rows and all 1 + k positions of each verify row, fed tokens
shifted by one), then ``step`` for draft steps 2..k (decode-only q_len-1 steps), each returning the
state the next step feeds back; ``logits`` reads drafts from the rows it is given. Both run eager.
"""

from __future__ import annotations

from typing import Protocol

import torch

from encore.backends.metadata import ForwardBatch


class ModelDrafter(Protocol):
    def first_pass(self, batch: ForwardBatch, input_ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """``target_hidden``: the target forward's output for every token of ``batch`` -> [T, H_draft]."""

    def step(self, batch: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """A further draft step fed the previous step's state [D, H_draft] -> [D, H_draft]."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[D, H_draft] -> float32 logits over the target vocab [D, V]."""


class MtpDrafter:
    """The checkpoint's nextn layer: fed the target's final-normed state, then its own normed output."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def first_pass(self, batch: ForwardBatch, input_ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.forward_mtp(batch, input_ids, target_hidden)

    def step(self, batch: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.forward_mtp(batch, input_ids, hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.model.mtp.compute_logits(hidden)


class Eagle3Drafter:
    """An EAGLE-3 draft model: fed ``fc`` of the target's three auxiliary states (the columns after
    the normed state in the target's output), then its own pre-norm output. Its logits cover the
    target vocab, -inf off the draft vocab, so a stochastic draft's q is the draft distribution
    scattered to target ids (zero elsewhere)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.hidden_size = runner.model.cfg.hidden_size

    def first_pass(self, batch: ForwardBatch, input_ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        aux = target_hidden[:, self.hidden_size:]  # [T, 3 * H_target]
        return self.runner.forward_eagle3(batch, input_ids, self.runner.eagle3.combine(aux))

    def step(self, batch: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.forward_eagle3(batch, input_ids, hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.eagle3.compute_logits(hidden)


def model_drafter(method: str, runner) -> ModelDrafter | None:
    """The model drafter of a speculative method; None for host drafters (n-gram, replay)."""
    if method == "mtp":
        return MtpDrafter(runner)
    if method == "eagle3":
        return Eagle3Drafter(runner)
    return None
