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


@dataclass(slots=True)
class ForwardBatch(StepShape):
    """Everything a forward pass needs to know about one step.

    Per token (``num_tokens``): ``input_ids``, ``positions``, ``slot_mapping`` (flat cache slot
    ``page * page_size + offset`` the token's latent is written to).
    Per row (``bs``): ``seq_lens`` (KV length after the step), ``prefix_lens`` (KV length before it),
    ``qo_indptr`` (``[bs + 1]`` token offsets), ``page_table`` (``[bs, max_pages]``, unused entries 0).
    ``gather_ids`` selects the logits rows: the last token of each prefill row that completes its
    prompt, then every token of every decode row.
    The ``*_cpu`` lists are the host values the step was built from: a graph key's padded step is
    written from them in one host-to-device copy per dtype (graphs/padding.py). A batch built on the
    device (a draft step) has none of the per-token ones and cannot be padded to a key.
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
