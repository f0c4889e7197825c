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

from encore.backends.host_tensors import put, view_at
from encore.backends.metadata import ForwardBatch
from encore.engine.kv_cache import DUMMY_PAGE
from encore.graphs.keys import GraphKey


class StepBuffers:
    """Device buffers for the largest key; ``fill`` writes a (padded) step into them.

    One device buffer holds a step's fields at fixed offsets, S being the largest key's tokens rounded
    up to 8: the input ids (int64, at 0), then a key's per-row fields as consecutive int32 slices
    (seq_lens [0, bs), prefix_lens [bs, 2bs), qo_indptr [2bs, 3bs + 1)) in a region of R bytes, then
    the positions and the slots (int64, S each), then room for page-table writes (below). One host
    buffer mirrors it, so a step is written into the host buffer from the batch's lists and arrives in
    one host-to-device copy, up to its last byte (each copy is ~10 µs of host time on an H100 host,
    and a pageable source is free again once the call returns). The ids and positions, a compiled
    graph's inputs, sit at the same offsets for every key, the ids at 0 as in a step built by
    ``engine.step.pack_batch`` (a guard on a view's storage offset then holds for all of a family's
    keys, and for the unpadded steps it runs), the others 64-byte aligned. A key's views of the fields
    are made once and handed out again.

    The page table is its own [rows, pages] buffer, every row its pages and then the dummy page (as
    ``ForwardBatch.page_table`` promises; a padded row is all dummy page). The host keeps what each
    row holds and a step writes only the entries that change: none while the rows keep their requests
    and pages (most decode steps), a row's new page, the rows of a request that arrived. Those entries'
    flat indices and values ride in the same copy and one indexed write puts them in place (before
    session 46 every step filled the rows with the dummy page and copied its table in: two launches).
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
        field = 8 * self.stride
        ints_bytes = -(-(3 * max_rows + 1) * 4 // 64) * 64
        entries = max_rows * max_pages  # page-table writes at most: every entry of every row
        # Byte offsets of the ids, the per-row ints, the positions, the slots and the page-table writes'
        # flat indices (int64); their values (int32) follow the indices of a step.
        self._at = (0, field, field + ints_bytes, 2 * field + ints_bytes, 3 * field + ints_bytes)
        size = 3 * field + ints_bytes + -(-12 * entries // 8) * 8  # whole int64s: the buffer is viewed as them
        self._data = torch.zeros(size, dtype=torch.uint8, device=device)
        # Whole-buffer views per dtype, made here: a dtype view made under inference mode (as ``fill``
        # runs) would be an inference tensor, whose dispatch keys a compiled graph's guards tell apart
        # from those of a step built by ``pack_batch``; slices of these views are not.
        self._typed = {dtype: self._data.view(dtype) for dtype in (torch.int64, torch.int32)}
        host = bytearray(size)
        self._host_bytes = memoryview(host)
        self._host_tensor = torch.frombuffer(host, dtype=torch.uint8)
        self.page_table = torch.full((max_rows, max_pages), DUMMY_PAGE, dtype=torch.int32, device=device)
        self._table_rows: list[list[int]] = [[] for _ in range(max_rows)]  # each row's pages on the device
        self._views: dict[GraphKey, tuple[torch.Tensor, ...]] = {}  # a key's fields
        self._no_tokens = torch.zeros(0, dtype=torch.int64, device=device)

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
            ids = positions = slots = seq = prefix = tables = []
            qo = [0]
        else:
            if batch.input_ids_cpu is None or batch.page_table_cpu is None:
                raise ValueError("a step built on the device (no host lists) cannot be padded to a graph key")
            e, n, D = batch.num_extends, batch.num_extend_tokens, batch.num_decodes
            ids, positions, slots = batch.input_ids_cpu, batch.positions_cpu, batch.slot_mapping_cpu
            seq, prefix, qo = batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.qo_indptr_cpu
            tables = batch.page_table_cpu
        dec_end = P + D * q
        pad_rows = bs - E - D  # padded decode rows: their tokens are [dec_end, T)
        pad_positions = list(range(q)) * pad_rows
        dummy = DUMMY_PAGE * self.page_size
        bucket = P - n  # the padded prefill rows' tokens, then padding owned by no row
        ints = (seq[:e] + [1] * (E - e) + seq[e:] + [q] * pad_rows
                + prefix[:e] + [0] * (E - e) + prefix[e:] + [0] * pad_rows
                + qo[:e + 1] + list(range(n + 1, n + E - e + 1))  # a padded prefill row: one token
                + [offset + bucket for offset in qo[e + 1:]]  # real decode rows start after the bucket
                + list(range(dec_end + q, T + 1, q)))
        # Each field at its offset in the host buffer; what lies between them is never read.
        host, (ids_at, ints_at, positions_at, slots_at, writes_at) = self._host_bytes, self._at
        put(host, ids_at, ids[:n] + [0] * bucket + ids[n:] + [0] * (T - dec_end), torch.int64)
        put(host, ints_at, ints, torch.int32)
        put(host, positions_at, positions[:n] + [0] * bucket + positions[n:] + pad_positions, torch.int64)
        pad_slots = [dummy + p % self.page_size for p in pad_positions]
        put(host, slots_at, slots[:n] + [dummy] * bucket + slots[n:] + pad_slots, torch.int64)
        index, values = self._table_writes(tables[:e] + [[]] * (E - e) + tables[e:] + [[]] * pad_rows)
        end = slots_at + 8 * T
        if index:
            put(host, writes_at, index, torch.int64)
            put(host, writes_at + 8 * len(index), values, torch.int32)
            end = writes_at + 12 * len(index)
        self._data[:end].copy_(self._host_tensor[:end], non_blocking=True)
        if index:
            writes = view_at(self._typed[torch.int64], writes_at, len(index))
            self.page_table.view(-1)[writes] = view_at(self._typed[torch.int32], writes_at + 8 * len(index),
                                                       len(values))
        table = self.page_table
        views = self._views.get(key)
        if views is None:
            longs, ints32 = self._typed[torch.int64], self._typed[torch.int32]
            views = self._views[key] = (
                view_at(longs, ids_at, T), view_at(longs, positions_at, T), view_at(longs, slots_at, T),
                view_at(ints32, ints_at, bs), view_at(ints32, ints_at + 4 * bs, bs),
                view_at(ints32, ints_at + 8 * bs, bs + 1))
        input_ids, positions_d, slots_d, seq_lens, prefix_lens, qo_indptr = views
        if batch is not None and batch.pending is not None:  # decode tokens: past the bucket's padding
            batch.pending.write(input_ids, bucket)
        return ForwardBatch(
            num_extends=E, q_len_per_req=q, bs=bs, num_tokens=T, page_size=self.page_size,
            input_ids=input_ids, positions=positions_d, slot_mapping=slots_d,
            seq_lens=seq_lens, prefix_lens=prefix_lens, qo_indptr=qo_indptr, page_table=table[:bs, :width],
            gather_ids=padded_index(batch, key, batch.gather_ids) if batch is not None else self._no_tokens,
            seq_lens_cpu=ints[:bs], prefix_lens_cpu=ints[bs:2 * bs],
        )

    def _table_writes(self, rows: list[list[int]]) -> tuple[list[int], list[int]]:
        """The page-table entries to write so that row i holds ``rows[i]``, then the dummy page: (flat
        indices, values), from where each row's new pages part from what it holds to the end of the
        longer of the two. Records a copy of each row it writes (a step's ``page_table_cpu`` holds the KV
        manager's own lists, which grow in later steps; engine.step.pack_batch), nothing for the others."""
        too_long = next((r for r, new in enumerate(rows) if len(new) > self.max_pages), None)
        if too_long is not None:  # before any row is recorded: what is recorded is what the device will hold
            raise ValueError(f"row {too_long} has {len(rows[too_long])} pages; the graph buffers hold {self.max_pages}")
        index: list[int] = []
        values: list[int] = []
        for r, (new, old) in enumerate(zip(rows, self._table_rows)):
            if new == old:
                continue
            same = next((i for i, (a, b) in enumerate(zip(new, old)) if a != b), min(len(new), len(old)))
            end = max(len(new), len(old))
            base = r * self.max_pages
            index += range(base + same, base + end)
            values += new[same:]
            values += [DUMMY_PAGE] * (end - max(same, len(new)))
            self._table_rows[r] = list(new)
        return index, values


def padded_index(batch: ForwardBatch, key: GraphKey, token_ids: torch.Tensor) -> torch.Tensor:
    """Token indices of ``batch`` -> indices of the same tokens in the step padded to ``key``: the
    decode tokens move past the prefill bucket's padding; where there is none (every DECODE step)
    the indices are the same tensor."""
    n = batch.num_extend_tokens
    shift = key.num_extend_tokens - n
    return token_ids + (token_ids >= n) * shift if shift else token_ids
