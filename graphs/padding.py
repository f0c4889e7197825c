"""Static step buffers and the padding of a step up to its graph key.

The buffers are allocated once at the largest key's size; a key's step is a set of leading views of
them, so a CUDA graph captured on those views reads whatever the next step copies in. Layout of a
padded step for key (E, q, bs, T), with e real prefill rows of n tokens, D real decode rows and
P = T - (bs - E)·q prefill tokens in the bucket:

    tokens [0, n)           real prefill tokens
    tokens [n, n + E - e)   the padded prefill rows' tokens, one each
    tokens [n + E - e, P)   padding owned by no row (qo_indptr[E] = n + E - e, so a ragged prefill
                            kernel never sees them); the backend must leave finite values in their
                            output rows
    tokens [P, P + D·q)     real decode tokens (qo_indptr[E + j] = P + j·q: offsets in the padded step)
    tokens [P + D·q, T)     padded decode rows' tokens: token 0 at positions 0..q-1
    rows   [0, e)           the real prefill rows
    rows   [e, E)           padded prefill rows: a one-token prompt (token 0 at position 0, seq_len 1)
    rows   [E, E + D)       the real decode rows
    rows   [E + D, bs)      padded decode rows: seq_len q

Every padded token is token 0, written to the dummy page (engine/kv_cache.py ``DUMMY_PAGE``): prefill
padding to its slot 0, a padded decode row's tokens to slots 0..q-1; padded rows' page tables are all
the dummy page, so they write and read only that page. Real rows never read it unmasked, and every
padded query sees at least one finite key, so no NaN can reach the page. Padded outputs are dropped:
``padded_index`` maps real token indices to padded ones (the token layout only moves decode tokens).
"""

from __future__ import annotations

import torch

from encore.backends.metadata import ForwardBatch
from encore.engine.kv_cache import DUMMY_PAGE
from encore.graphs.keys import GraphKey


class StepBuffers:
    """Device buffers for the largest key; ``fill`` writes a (padded) step into them."""

    def __init__(self, max_tokens: int, max_rows: int, max_pages: int, page_size: int, device: torch.device,
                 full_page_table: bool) -> None:
        """``full_page_table``: hand out all ``max_pages`` columns (a captured graph's shapes are fixed);
        otherwise only as many as the step uses."""
        self.page_size = page_size
        self.max_pages = max_pages
        self.full_page_table = full_page_table
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.prefix_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.qo_indptr = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32, device=device)
        # 0, 1, 2, ...: positions of a padded decode row's tokens, and row counts for qo_indptr.
        self._pad_positions = torch.arange(max(max_tokens, max_rows + 1), device=device)

    def fill(self, key: GraphKey, batch: ForwardBatch | None) -> ForwardBatch:
        """Copies ``batch`` (None: an all-padding step, for warm-up and capture) into the buffers,
        padded to ``key``; returns the step as views of the buffers."""
        q, E, T = key.q_len_per_req, key.num_extends, key.num_tokens
        P = key.num_extend_tokens
        e = batch.num_extends if batch is not None else 0
        n = batch.num_extend_tokens if batch is not None else 0
        D = batch.num_decodes if batch is not None else 0
        width = self.max_pages if self.full_page_table or batch is None else batch.page_table.shape[1]
        if width > self.max_pages:
            raise ValueError(f"step uses {width} pages per row; the graph buffers hold {self.max_pages}")
        dec_end = P + D * q

        ids, pos, slots = self.input_ids, self.positions, self.slot_mapping
        if n:
            ids[:n].copy_(batch.input_ids[:n])
            pos[:n].copy_(batch.positions[:n])
            slots[:n].copy_(batch.slot_mapping[:n])
        if D:
            ids[P:dec_end].copy_(batch.input_ids[n:])
            pos[P:dec_end].copy_(batch.positions[n:])
            slots[P:dec_end].copy_(batch.slot_mapping[n:])
        if P > n:
            ids[n:P].zero_()
            pos[n:P].zero_()
            slots[n:P].fill_(DUMMY_PAGE * self.page_size)
        pad_decode_rows = key.bs - E - D  # their tokens: [dec_end, T)
        if pad_decode_rows:
            offsets = self._pad_positions[:q].repeat(pad_decode_rows)  # [pad_decode_rows * q]
            ids[dec_end:T].zero_()
            pos[dec_end:T].copy_(offsets)
            slots[dec_end:T].copy_(offsets % self.page_size + DUMMY_PAGE * self.page_size)

        # Rows. qo_indptr[0] is 0 from allocation and never written.
        seq_lens, prefix_lens, indptr, table = self.seq_lens, self.prefix_lens, self.qo_indptr, self.page_table
        table[:key.bs, :width].fill_(DUMMY_PAGE)
        if e:
            seq_lens[:e].copy_(batch.seq_lens[:e])
            prefix_lens[:e].copy_(batch.prefix_lens[:e])
            indptr[1:e + 1].copy_(batch.qo_indptr[1:e + 1])
            table[:e, :batch.page_table.shape[1]].copy_(batch.page_table[:e])
        if D:
            seq_lens[E:E + D].copy_(batch.seq_lens[e:])
            prefix_lens[E:E + D].copy_(batch.prefix_lens[e:])
            # Real decode rows start after the prefill bucket.
            torch.add(batch.qo_indptr[e + 1:], P - n, out=indptr[E + 1:E + D + 1])
            table[E:E + D, :batch.page_table.shape[1]].copy_(batch.page_table[e:])
        if E > e:
            seq_lens[e:E].fill_(1)
            prefix_lens[e:E].zero_()
            indptr[e + 1:E + 1].copy_(n + self._pad_positions[1:E - e + 1])
        if pad_decode_rows:
            seq_lens[E + D:key.bs].fill_(q)
            prefix_lens[E + D:key.bs].zero_()
            indptr[E + D + 1:key.bs + 1].copy_(dec_end + q * self._pad_positions[1:pad_decode_rows + 1])

        seq_cpu = batch.seq_lens_cpu if batch is not None else []
        prefix_cpu = batch.prefix_lens_cpu if batch is not None else []
        return ForwardBatch(
            num_extends=E, q_len_per_req=q, bs=key.bs, num_tokens=T, page_size=self.page_size,
            input_ids=ids[:T], positions=pos[:T], slot_mapping=slots[:T],
            seq_lens=seq_lens[:key.bs], prefix_lens=prefix_lens[:key.bs], qo_indptr=indptr[:key.bs + 1],
            page_table=table[:key.bs, :width],
            gather_ids=padded_index(batch, key, batch.gather_ids) if batch is not None else ids.new_zeros(0),
            seq_lens_cpu=seq_cpu[:e] + [1] * (E - e) + seq_cpu[e:] + [q] * pad_decode_rows,
            prefix_lens_cpu=prefix_cpu[:e] + [0] * (E - e) + prefix_cpu[e:] + [0] * pad_decode_rows,
        )


def padded_index(batch: ForwardBatch, key: GraphKey, token_ids: torch.Tensor) -> torch.Tensor:
    """Token indices of ``batch`` -> indices of the same tokens in the step padded to ``key``: the
    decode tokens move past the prefill bucket's padding; where there is none (every DECODE step)
    the indices are the same tensor."""
    n = batch.num_extend_tokens
    shift = key.num_extend_tokens - n
    return token_ids + (token_ids >= n) * shift if shift else token_ids
