"""Model drafters: the MTP layer and the EAGLE-3 draft model behind one interface.

The speculator drives both the same way (speculator.py): a first pass over the step's own layout
right after the target forward (prefill rows and all 1 + k positions of each verify row, fed tokens
shifted by one and ``first_input`` of the target's output), then draft steps 2..k (decode-only
q_len-1 steps), each fed the state the previous one returned; ``logits`` reads drafts from the rows
it is given. ``forward`` is the bare module call: the speculator binds the step context around it
when the drafter's attention reads it (``uses_step_context``), eager or inside a draft graph
(draft_graphs.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from encore.backends.metadata import ForwardBatch


class ModelDrafter(Protocol):
    uses_step_context: bool  # its attention is the target's backend, reading the bound step

    def first_input(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target forward's output for every token [T, *] -> the first pass's states [T, H_draft]."""

    def forward(self, batch: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One pass over ``batch`` fed ``input_ids`` and states [T, H_draft] -> next states [T, H_draft]."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[D, H_draft] -> float32 logits over the target vocab [D, V]."""

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """[D, H_draft] -> greedy drafts [D] (target ids), without building float32 logits."""


class MtpDrafter:
    """The checkpoint's nextn layer: fed the target's final-normed state, then its own normed output.
    Its attention is an MLA layer of the target's backend (its own latent cache layer)."""

    uses_step_context = True

    def __init__(self, model) -> None:
        self.mtp = model.mtp

    def first_input(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def forward(self, batch: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp(input_ids, batch.positions, hidden, batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.compute_logits(hidden)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.greedy_tokens(hidden)


class Eagle3Drafter:
    """An EAGLE-3 draft model: fed ``fc`` of the target's three auxiliary states (the columns after
    the normed state in the target's output), then its own pre-norm output. Its logits cover the
    target vocab, -inf off the draft vocab, so a stochastic draft's q is the draft distribution
    scattered to target ids (zero elsewhere). Its attention reads the batch directly
    (draft_kv_cache.py), not the step context: in a decode-only pass, one custom op over the batch's
    tensors, so it compiles like the MTP layer."""

    uses_step_context = False

    def __init__(self, eagle3, target_hidden_size: int) -> None:
        self.eagle3 = eagle3
        self.hidden_size = target_hidden_size

    def first_input(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.eagle3.combine(target_hidden[:, self.hidden_size:])  # from [T, 3 * H_target]

    def forward(self, batch: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eagle3(input_ids, batch.positions, hidden, batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.eagle3.compute_logits(hidden)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.eagle3.greedy_tokens(hidden)


def model_drafter(method: str, runner) -> ModelDrafter | None:
    """The model drafter of a speculative method; None for host drafters (n-gram, replay)."""
    if method == "mtp":
        return MtpDrafter(runner.model)
    if method == "eagle3":
        return Eagle3Drafter(runner.eagle3, runner.model.cfg.hidden_size)
    return None
