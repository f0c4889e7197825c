"""Builds the step layout (``ForwardBatch``) from the scheduler's rows: host lists, one copy each."""

from __future__ import annotations

import torch

from encore.backends.metadata import ForwardBatch
from encore.engine.kv_cache import KVCacheManager
from encore.engine.request import Request
from encore.engine.sampler import SamplingTensors, needs_token_history
from encore.engine.scheduler import ScheduledStep


def build_forward_batch(step: ScheduledStep, kv: KVCacheManager, device: torch.device
                        ) -> tuple[ForwardBatch, list[Request]]:
    """Returns the batch and, per logits row, the request it samples for.

    Prefill rows produce a logits row only when the chunk completes the request's pending tokens;
    decode rows feed their last token plus ``q_len_per_req - 1`` draft tokens and produce a logits
    row per token.
    """
    page_size = kv.page_size
    rows: list[tuple[Request, int]] = step.extends + [(r, step.q_len_per_req) for r in step.decodes]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    prefix_lens: list[int] = []
    qo_indptr = [0]
    tables: list[list[int]] = []
    gather_ids: list[int] = []
    sampled: list[Request] = []
    for i, (req, n) in enumerate(rows):
        start = req.num_computed
        end = start + n
        table = kv.table(req.request_id)
        if i < len(step.extends):
            input_ids.extend(req.token_ids[start:end])
        else:
            fed = req.token_ids[start:start + 1] + req.draft_token_ids[:n - 1]
            if len(fed) != n:
                raise ValueError(f"decode row {req.request_id!r} has {len(fed) - 1} draft tokens; "
                                 f"q_len_per_req {n} needs {n - 1}")
            input_ids.extend(fed)
        positions.extend(range(start, end))
        slots.extend(table[p // page_size] * page_size + p % page_size for p in range(start, end))
        seq_lens.append(end)
        prefix_lens.append(start)
        qo_indptr.append(qo_indptr[-1] + n)
        tables.append(table)
        if i >= len(step.extends):
            gather_ids.extend(range(qo_indptr[-2], qo_indptr[-1]))
            sampled.extend([req] * n)
        elif end == len(req.token_ids):
            gather_ids.append(qo_indptr[-1] - 1)
            sampled.append(req)
    max_pages = max((len(t) for t in tables), default=0)
    page_table = [t + [0] * (max_pages - len(t)) for t in tables]

    def to(data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

    batch = ForwardBatch(
        num_extends=len(step.extends),
        q_len_per_req=step.q_len_per_req,
        bs=len(rows),
        num_tokens=len(input_ids),
        page_size=page_size,
        input_ids=to(input_ids, torch.int64),
        positions=to(positions, torch.int64),
        slot_mapping=to(slots, torch.int64),
        seq_lens=to(seq_lens, torch.int32),
        prefix_lens=to(prefix_lens, torch.int32),
        qo_indptr=to(qo_indptr, torch.int32),
        page_table=to(page_table, torch.int32).view(len(rows), max_pages),
        gather_ids=to(gather_ids, torch.int64),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
    )
    return batch, sampled


def sampling_tensors(sampled: list[Request], device: torch.device) -> SamplingTensors:
    """One row per logits row; token histories are copied only when some row's penalties read them."""
    params = [r.params for r in sampled]
    history = needs_token_history(params)
    return SamplingTensors.build(params, [r.seed for r in sampled], [r.num_output_tokens for r in sampled],
                                 [r.prompt_token_ids if history else () for r in sampled],
                                 [r.output_token_ids if history else () for r in sampled], device)
