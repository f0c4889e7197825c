"""The step layout: one contract shared by the scheduler, the step builder, the model and every backend.

A step holds ``bs`` rows. Rows ``[0, num_extends)`` are prefill (extend) rows, ragged, and their tokens
come first; rows ``[num_extends, bs)`` are decode rows of exactly ``q_len_per_req`` tokens each (1 for a
plain decode, 1 + k for a speculative verify). Every tensor lives on the model's device; the few host
copies (``*_cpu``) exist so that host-side planning never has to read the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from encore.backends.host_tensors import host_tensor


class ForwardMode(enum.Enum):
    EXTEND = "EXTEND"  # num_extends == bs
    DECODE = "DECODE"  # num_extends == 0
    MIXED = "MIXED"  # 0 < num_extends < bs
    IDLE = "IDLE"  # bs == 0

    @staticmethod
    def of(num_extends: int, bs: int) -> ForwardMode:
        if bs == 0:
            return ForwardMode.IDLE
        if num_extends == bs:
            return ForwardMode.EXTEND
        if num_extends == 0:
            return ForwardMode.DECODE
        return ForwardMode.MIXED


class StepShape:
    """What follows from (num_extends, q_len_per_req, bs, num_tokens): shared by a step's batch and
    the graph key it runs on."""

    __slots__ = ()
    num_extends: int
    q_len_per_req: int
    bs: int
    num_tokens: int

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.of(self.num_extends, self.bs)

    @property
    def num_decodes(self) -> int:
        return self.bs - self.num_extends

    @property
    def num_extend_tokens(self) -> int:
        return self.num_tokens - self.num_decodes * self.q_len_per_req


@dataclass(frozen=True, slots=True)
class PendingInputs:
    """Decode tokens of a step whose ids the step before it left on the device — its sampled ids
    (overlapped steps, engine/engine.py) or its drafts (engine/spec/speculator.py): token ``tokens[i]``
    of the step is ``source[rows[i]]``. The host lists hold a placeholder there; ``write`` puts the ids
    in on the device, in stream order after that step."""

    tokens: list[int]  # indices in the unpadded step, increasing
    source: torch.Tensor  # [N] int64: the sampled ids of the step before (one per logits row), or its drafts
    rows: list[int]  # indices into ``source``

    def write(self, input_ids: torch.Tensor, offset: int = 0) -> None:
        """Writes the ids into ``input_ids`` at ``tokens`` + ``offset`` (a padded step's decode tokens
        sit ``offset`` further on: graphs/padding.py). Where both index lists are runs, one slice copy;
        otherwise one small upload and a gather."""
        n, first, row = len(self.tokens), self.tokens[0] + offset, self.rows[0]
        if self.tokens[-1] - self.tokens[0] == n - 1 and self.rows == list(range(row, row + n)):
            input_ids[first:first + n].copy_(self.source[row:row + n])
            return
        index = host_tensor([t + offset for t in self.tokens] + self.rows, torch.int64).to(
            input_ids.device, non_blocking=True)
        input_ids[index[:n]] = self.source[index[n:]]


@dataclass(slots=True)
class ForwardBatch(StepShape):
    """Everything a forward pass needs to know about one step.

    Per token (``num_tokens``): ``input_ids``, ``positions``, ``slot_mapping`` (flat cache slot
    ``page * page_size + offset`` the token's latent is written to).
    Per row (``bs``): ``seq_lens`` (KV length after the step), ``prefix_lens`` (KV length before it),
    ``qo_indptr`` (``[bs + 1]`` token offsets), ``page_table`` (``[bs, max_pages]``, unused entries 0).
    ``gather_ids`` selects the logits rows: the last token of each prefill row that completes its
    prompt, then every token of every decode row.
    The ``*_cpu`` lists are the host values the step was built from (``page_table_cpu``: each row's
    pages, unpadded): a graph key's padded step is written from them (graphs/padding.py). A batch built
    on the device (a draft step) has none of the per-token ones and cannot be padded to a key.
    ``pending``: decode tokens whose ids are still on the device, in ``input_ids`` once
    ``resolve_pending`` (or, padded, ``StepBuffers.fill``) has run.
    """

    num_extends: int
    q_len_per_req: int
    bs: int
    num_tokens: int
    page_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [bs] int32
    prefix_lens: torch.Tensor  # [bs] int32
    qo_indptr: torch.Tensor  # [bs + 1] int32
    page_table: torch.Tensor  # [bs, max_pages] int32
    gather_ids: torch.Tensor  # [N] int64
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    input_ids_cpu: list[int] | None = None
    positions_cpu: list[int] | None = None
    slot_mapping_cpu: list[int] | None = None
    qo_indptr_cpu: list[int] | None = None
    page_table_cpu: list[list[int]] | None = None
    pending: PendingInputs | None = None

    def resolve_pending(self) -> None:
        """Writes the pending ids into ``input_ids`` (once)."""
        if self.pending is not None:
            self.pending.write(self.input_ids)
            self.pending = None
