"""Builds the step layout (``ForwardBatch``) from the scheduler's rows: host lists, one copy in all."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from encore.backends.host_tensors import upload
from encore.backends.metadata import ForwardBatch, PendingInputs
from encore.engine.kv_cache import DUMMY_PAGE, KVCacheManager
from encore.engine.request import Request
from encore.engine.sampler import SamplingTensors, needs_token_history
from encore.engine.scheduler import ScheduledStep


@dataclass(frozen=True, slots=True)
class DeviceDrafts:
    """Drafts a model drafter left on the device for the next step's verify rows: request ``id``'s k
    drafts are row ``rows[id]`` of ``drafts`` (engine/spec/speculator.py)."""

    drafts: torch.Tensor  # [D, k] int64
    rows: dict[str, int]


def build_forward_batch(step: ScheduledStep, kv: KVCacheManager, device: torch.device,
                        in_flight: torch.Tensor | None = None, stream: torch.cuda.Stream | None = None,
                        drafts: DeviceDrafts | None = None) -> tuple[ForwardBatch, list[Request]]:
    """Returns the batch and, per logits row, the request it samples for; ``stream``: where its upload
    runs (``pack_batch``).

    Prefill rows produce a logits row only when the chunk completes the request's pending tokens;
    decode rows feed their last token plus ``q_len_per_req - 1`` draft tokens and produce a logits
    row per token. A decode row whose last token the step in flight sampled (``Request.num_pending``)
    feeds it from ``in_flight``, that step's sampled ids on the device; a verify row named in
    ``drafts`` feeds its drafts from there (either way ``ForwardBatch.pending``).
    """
    page_size = kv.page_size
    q = step.q_len_per_req
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    prefix_lens: list[int] = []
    qo_indptr = [0]
    tables: list[list[int]] = []
    gather_ids: list[int] = []
    sampled: list[Request] = []
    for req, n in step.extends:
        start = req.num_computed
        end = start + n
        table = kv.table(req.request_id)
        input_ids += req.token_ids[start:end]
        positions += range(start, end)
        slots += (table[p // page_size] * page_size + p % page_size for p in range(start, end))
        seq_lens.append(end)
        prefix_lens.append(start)
        qo_indptr.append(qo_indptr[-1] + n)
        tables.append(table)
        if end == len(req.token_ids):
            gather_ids.append(qo_indptr[-1] - 1)
            sampled.append(req)
    first = qo_indptr[-1]  # the decode rows' tokens follow the prefill rows', q each: all logits rows
    pending_tokens: list[int] = []
    pending_rows: list[int] = []
    for req in step.decodes:
        start = req.num_computed
        table = kv.table(req.request_id)
        if req.num_pending:
            if in_flight is None or q != 1 or req.num_pending != 1:
                raise RuntimeError(f"decode row {req.request_id!r} feeds a token no step in flight holds "
                                   f"({req.num_pending} pending, q_len_per_req {q})")
            pending_tokens.append(len(input_ids))
            pending_rows.append(req.pending_row)
        if drafts is not None and req.request_id in drafts.rows:
            at = drafts.rows[req.request_id] * (q - 1)
            pending_tokens += range(len(input_ids) + 1, len(input_ids) + q)
            pending_rows += range(at, at + q - 1)
            fed = req.token_ids[start:start + 1] + [0] * (q - 1)
        elif q > 1:
            fed = req.token_ids[start:start + 1] + req.draft_token_ids[:q - 1]
        else:
            fed = req.token_ids[start:start + 1]
        if len(fed) != q:
            raise ValueError(f"decode row {req.request_id!r} has {len(fed) - 1} draft tokens; "
                             f"q_len_per_req {q} needs {q - 1}")
        input_ids += fed
        if q == 1:
            positions.append(start)
            slots.append(table[start // page_size] * page_size + start % page_size)
        else:
            positions += range(start, start + q)
            slots += (table[p // page_size] * page_size + p % page_size for p in range(start, start + q))
        seq_lens.append(start + q)
        prefix_lens.append(start)
        tables.append(table)
    num_decodes = len(step.decodes)
    qo_indptr += range(first + q, first + q * num_decodes + 1, q)
    gather_ids += range(first, first + q * num_decodes)
    sampled += step.decodes if q == 1 else [req for req in step.decodes for _ in range(q)]
    batch = pack_batch(len(step.extends), step.q_len_per_req, page_size, input_ids, positions, slots, seq_lens,
                       prefix_lens, qo_indptr, tables, gather_ids, device, stream)
    if pending_tokens:
        batch.pending = PendingInputs(pending_tokens, in_flight if in_flight is not None else drafts.drafts.reshape(-1),
                                      pending_rows)
    return batch, sampled


def pack_batch(num_extends: int, q_len_per_req: int, page_size: int, input_ids: list[int], positions: list[int],
               slots: list[int], seq_lens: list[int], prefix_lens: list[int], qo_indptr: list[int],
               tables: list[list[int]], gather_ids: list[int], device: torch.device,
               stream: torch.cuda.Stream | None = None) -> ForwardBatch:
    """The step layout from its host lists, in one host-to-device copy (``host_tensors.upload``, on
    ``stream`` if given) split into views on the device; page-table rows are padded with 0 to the
    longest. ``page_table_cpu`` holds ``tables`` themselves (the KV manager's own lists, which grow in
    later steps: ``StepBuffers`` copies a row only when it changes).
    A DECODE step that replays a graph key with all its rows greedy reads none of these device tensors
    (graphs/padding.py writes the key's buffers from the host lists), so on CUDA the engine sends them
    on a stream of their own, where the copy need not wait behind the step before."""
    max_pages = max((len(t) for t in tables), default=0)
    flat_table: list[int] = []  # [bs * max_pages]
    for t in tables:
        flat_table += t
        flat_table += [0] * (max_pages - len(t))
    tokens, bs = len(input_ids), len(seq_lens)
    longs, ints = upload([(input_ids + positions + slots + gather_ids, torch.int64),
                          (seq_lens + prefix_lens + qo_indptr + flat_table, torch.int32)], device, stream)
    return ForwardBatch(
        num_extends=num_extends,
        q_len_per_req=q_len_per_req,
        bs=bs,
        num_tokens=tokens,
        page_size=page_size,
        input_ids=longs[:tokens],
        positions=longs[tokens:2 * tokens],
        slot_mapping=longs[2 * tokens:3 * tokens],
        seq_lens=ints[:bs],
        prefix_lens=ints[bs:2 * bs],
        qo_indptr=ints[2 * bs:3 * bs + 1],
        page_table=ints[3 * bs + 1:].view(bs, max_pages),
        gather_ids=longs[3 * tokens:],
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        input_ids_cpu=input_ids,
        positions_cpu=positions,
        slot_mapping_cpu=slots,
        qo_indptr_cpu=qo_indptr,
        page_table_cpu=tables,
    )


def scratch_batch(extend_lens: list[int], num_decodes: int, q_len: int, width: int, page_size: int,
                  device: torch.device) -> ForwardBatch:
    """A step on the dummy page alone (kv_cache.DUMMY_PAGE): prefill rows of ``extend_lens`` tokens,
    then ``num_decodes`` decode rows of ``q_len``, every row's table ``width`` pages wide (at least its
    length). Every token's latent goes to, and every key is read from, that scratch page: the step runs
    the kernels of a real one of its shape (ModelRunner.warm_up_kernels), its outputs mean nothing."""
    lens = list(extend_lens) + [q_len] * num_decodes
    if width * page_size < max(lens, default=0):
        raise ValueError(f"a table of {width} pages of {page_size} cannot hold a row of {max(lens)} tokens")
    positions = [p for n in lens for p in range(n)]
    return pack_batch(len(extend_lens), q_len, page_size, [0] * len(positions), positions,
                      [DUMMY_PAGE * page_size + p % page_size for p in positions], lens, [0] * len(lens),
                      list(accumulate(lens, initial=0)), [[DUMMY_PAGE] * width] * len(lens), [], device)


def sampling_tensors(sampled: list[Request], device: torch.device) -> SamplingTensors:
    """One row per logits row; token histories are copied only when some row's penalties read them."""
    params = [r.params for r in sampled]
    history = needs_token_history(params)
    return SamplingTensors.build(params, [r.seed for r in sampled], [r.num_output_tokens for r in sampled],
                                 [r.prompt_token_ids if history else () for r in sampled],
                                 [r.output_token_ids if history else () for r in sampled], device)
