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

import array

import torch

from encore.backends.host_tensors import host_tensor
from encore.backends.metadata import ForwardBatch
from encore.engine.kv_cache import DUMMY_PAGE
from encore.graphs.keys import GraphKey


class StepBuffers:
    """Device buffers for the largest key; ``fill`` writes a (padded) step into them.

    The per-token fields share one int64 buffer at fixed offsets (input ids at 0, positions at S, slots
    at 2S, S: the largest key's tokens rounded up to 8) and a key's per-row fields are consecutive
    slices of one int32 buffer (seq_lens [0, bs), prefix_lens [bs, 2bs), qo_indptr [2bs, 3bs + 1)), so
    that a step arrives in one host-to-device copy per dtype, built on the host from the batch's lists;
    the page table is its own [rows, pages] buffer, written on the device from the batch's table (as
    wide as the step's longest row, where the key's may be wider). The ids and positions, a compiled
    graph's inputs, sit at the same 64-byte-aligned offsets for every key: a guard on a view's storage
    offset then holds for all of a family's keys.
    """

    def __init__(self, max_tokens: int, max_rows: int, max_pages: int, page_size: int, device: torch.device,
                 full_page_table: bool) -> None:
        """``full_page_table``: hand out all ``max_pages`` columns (a captured graph's shapes are fixed);
        otherwise only as many as the step uses."""
        self.device = device
        self.page_size = page_size
        self.max_pages = max_pages
        self.full_page_table = full_page_table
        self.stride = -(-max_tokens // 8) * 8
        self.longs = torch.zeros(3 * self.stride, dtype=torch.int64, device=device)
        self._zeros = array.array("q", bytes(8 * self.stride))
        self.ints = torch.zeros(3 * max_rows + 1, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32, device=device)

    def fill(self, key: GraphKey, batch: ForwardBatch | None) -> ForwardBatch:
        """Copies ``batch`` (None: an all-padding step, for warm-up and capture) into the buffers,
        padded to ``key``; returns the step as views of the buffers."""
        q, E, T, bs = key.q_len_per_req, key.num_extends, key.num_tokens, key.bs
        P = key.num_extend_tokens
        width = self.max_pages if self.full_page_table or batch is None else batch.page_table.shape[1]
        if width > self.max_pages:
            raise ValueError(f"step uses {width} pages per row; the graph buffers hold {self.max_pages}")
        if batch is None:
            e = n = D = 0
            ids = positions = slots = seq = prefix = []
            qo = [0]
        else:
            if batch.input_ids_cpu is None:
                raise ValueError("a step built on the device (no host lists) cannot be padded to a graph key")
            e, n, D = batch.num_extends, batch.num_extend_tokens, batch.num_decodes
            ids, positions, slots = batch.input_ids_cpu, batch.positions_cpu, batch.slot_mapping_cpu
            seq, prefix, qo = batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.qo_indptr_cpu
        dec_end = P + D * q
        pad_rows = bs - E - D  # padded decode rows: their tokens are [dec_end, T)
        pad_positions = list(range(q)) * pad_rows
        dummy = DUMMY_PAGE * self.page_size
        bucket = P - n  # the padded prefill rows' tokens, then padding owned by no row
        S = self.stride
        gap = self._zeros[:S - T]  # up to the next field's offset; an array, copied without conversion
        longs = array.array("q", ids[:n] + [0] * bucket + ids[n:] + [0] * (T - dec_end))
        longs += gap
        longs.extend(positions[:n] + [0] * bucket + positions[n:] + pad_positions)
        longs += gap
        longs.extend(slots[:n] + [dummy] * bucket + slots[n:] + [dummy + p % self.page_size for p in pad_positions])
        ints = (seq[:e] + [1] * (E - e) + seq[e:] + [q] * pad_rows
                + prefix[:e] + [0] * (E - e) + prefix[e:] + [0] * pad_rows
                + qo[:e + 1] + list(range(n + 1, n + E - e + 1))  # a padded prefill row: one token
                + [offset + bucket for offset in qo[e + 1:]]  # real decode rows start after the bucket
                + list(range(dec_end + q, T + 1, q)))
        self.longs[:2 * S + T].copy_(torch.frombuffer(longs, dtype=torch.int64), non_blocking=True)
        self.ints[:3 * bs + 1].copy_(host_tensor(ints, torch.int32), non_blocking=True)
        table = self.page_table
        table[:bs, :width].fill_(DUMMY_PAGE)
        if batch is not None:
            used = batch.page_table.shape[1]
            if E == e:
                table[:e + D, :used].copy_(batch.page_table)
            else:
                table[:e, :used].copy_(batch.page_table[:e])
                table[E:E + D, :used].copy_(batch.page_table[e:])
        return ForwardBatch(
            num_extends=E, q_len_per_req=q, bs=bs, num_tokens=T, page_size=self.page_size,
            input_ids=self.longs[:T], positions=self.longs[S:S + T], slot_mapping=self.longs[2 * S:2 * S + T],
            seq_lens=self.ints[:bs], prefix_lens=self.ints[bs:2 * bs], qo_indptr=self.ints[2 * bs:3 * bs + 1],
            page_table=table[:bs, :width],
            gather_ids=padded_index(batch, key, batch.gather_ids) if batch is not None else self.longs.new_zeros(0),
            seq_lens_cpu=ints[:bs], prefix_lens_cpu=ints[bs:2 * bs],
        )


def padded_index(batch: ForwardBatch, key: GraphKey, token_ids: torch.Tensor) -> torch.Tensor:
    """Token indices of ``batch`` -> indices of the same tokens in the step padded to ``key``: the
    decode tokens move past the prefill bucket's padding; where there is none (every DECODE step)
    the indices are the same tensor."""
    n = batch.num_extend_tokens
    shift = key.num_extend_tokens - n
    return token_ids + (token_ids >= n) * shift if shift else token_ids
