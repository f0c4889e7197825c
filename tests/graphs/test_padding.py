"""Padding a step to its key: the layout, and that padding never changes a real token's result or
touches anything but the dummy page."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from encore.engine.kv_cache import DUMMY_PAGE
from encore.engine.step import pack_batch
from encore.graphs.keys import GraphKey
from encore.graphs.padding import StepBuffers, padded_index
from graph_helpers import PADDED_KEYS, engine_with_history, rel_err


@pytest.fixture(scope="module")
def history(checkpoint):
    return engine_with_history(checkpoint("v3"))


def buffers_for(engine, key, full=False):
    return StepBuffers(key.num_tokens, key.bs, engine.runner.max_pages_per_row, 4, engine.runner.device, full)


def test_mixed_step_layout(history):
    engine, batches = history
    batch, key = batches["MIXED"], GraphKey(1, 1, 4, 8 + 3)  # 5 prefill tokens -> 8; 2 decode rows -> 3
    padded = buffers_for(engine, key).fill(key, batch)
    assert (padded.num_extends, padded.bs, padded.num_tokens, padded.num_extend_tokens) == (1, 4, 11, 8)
    assert padded.input_ids[:5].tolist() == batch.input_ids[:5].tolist()
    assert padded.input_ids[8:10].tolist() == batch.input_ids[5:].tolist()
    assert padded.input_ids[5:8].tolist() == [0, 0, 0] and padded.input_ids[10:].tolist() == [0]
    assert padded.positions[5:8].tolist() == [0, 0, 0]
    dummy = set(range(DUMMY_PAGE * 4, DUMMY_PAGE * 4 + 4))
    assert set(padded.slot_mapping[5:8].tolist()) <= dummy and set(padded.slot_mapping[10:].tolist()) <= dummy
    assert padded.qo_indptr.tolist() == [0, 5, 9, 10, 11]  # prefill padding [5, 8) belongs to no row
    assert padded.seq_lens.tolist() == batch.seq_lens.tolist() + [1]
    assert padded.page_table[3].tolist() == [DUMMY_PAGE] * padded.page_table.shape[1]
    assert padded.seq_lens_cpu == batch.seq_lens_cpu + [1]
    assert padded_index(batch, key, torch.arange(batch.num_tokens)).tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert padded.gather_ids.tolist() == padded_index(batch, key, batch.gather_ids).tolist()


def test_prefill_rows_pad_to_one_token_prompts_on_the_dummy_page(history):
    engine, batches = history
    batch, key = batches["MIXED"], GraphKey(3, 1, 7, 12 + 4)  # 1 -> 3 prefill rows, 2 -> 4 decode rows
    padded = buffers_for(engine, key).fill(key, batch)
    assert (padded.num_extends, padded.bs, padded.num_tokens, padded.num_extend_tokens) == (3, 7, 16, 12)
    # row 0: the real prompt [0, 5); rows 1, 2: a token each [5, 7); [7, 12) no row's; decodes from 12
    assert padded.qo_indptr.tolist() == [0, 5, 6, 7, 13, 14, 15, 16]
    assert padded.input_ids[5:12].tolist() == [0] * 7 and padded.positions[5:12].tolist() == [0] * 7
    assert padded.input_ids[12:14].tolist() == batch.input_ids[5:].tolist()
    dummy_row = [DUMMY_PAGE] * padded.page_table.shape[1]
    real_seq, real_prefix = batch.seq_lens.tolist(), batch.prefix_lens.tolist()
    assert padded.seq_lens.tolist() == real_seq[:1] + [1, 1] + real_seq[1:] + [1, 1]
    assert padded.prefix_lens.tolist() == real_prefix[:1] + [0, 0] + real_prefix[1:] + [0, 0]
    assert padded.seq_lens_cpu == padded.seq_lens.tolist() and padded.prefix_lens_cpu == padded.prefix_lens.tolist()
    for row, source in ((0, 0), (3, 1), (4, 2)):
        assert padded.page_table[row, :batch.page_table.shape[1]].tolist() == batch.page_table[source].tolist()
    for row in (1, 2, 5, 6):
        assert padded.page_table[row].tolist() == dummy_row
    assert padded_index(batch, key, torch.arange(batch.num_tokens)).tolist() == [0, 1, 2, 3, 4, 12, 13]


def test_full_page_table_keeps_its_width(history):
    engine, batches = history
    key = PADDED_KEYS["DECODE"]
    padded = buffers_for(engine, key, full=True).fill(key, batches["DECODE"])
    assert padded.page_table.shape == (4, engine.runner.max_pages_per_row)


@pytest.mark.parametrize("mode, key", [*PADDED_KEYS.items(), ("MIXED", GraphKey(3, 1, 7, 16)),
                                       ("EXTEND", GraphKey(3, 1, 3, 8))],
                         ids=[*PADDED_KEYS, "MIXED-padded-rows", "EXTEND-padded-rows"])
def test_padded_step_gives_real_tokens_the_same_hidden_states(mode, key, history):
    engine, batches = history
    batch = batches[mode]
    runner = engine.runner
    caches_before = [c.clone() for c in runner.kv_caches]
    padded = buffers_for(engine, key).fill(key, batch)
    with torch.inference_mode():
        with runner.context.bind(padded):
            got = runner.model(padded.input_ids, padded.positions, padded)
        padded_caches = [c.clone() for c in runner.kv_caches]
        for cache, before in zip(runner.kv_caches, caches_before):
            cache.copy_(before)
        want = runner.forward(batch)
    assert rel_err(got[padded_index(batch, key, torch.arange(batch.num_tokens))], want) < 1e-5
    for padded_cache, cache in zip(padded_caches, runner.kv_caches):  # padding wrote the dummy page only
        assert torch.allclose(padded_cache[DUMMY_PAGE + 1:], cache[DUMMY_PAGE + 1:], atol=1e-6)


def test_all_padding_step_writes_only_the_dummy_page(history):
    engine, _ = history
    runner = engine.runner
    before = [c[DUMMY_PAGE + 1:].clone() for c in runner.kv_caches]
    for key in (*PADDED_KEYS.values(), GraphKey(3, 1, 7, 16)):
        padded = buffers_for(engine, key).fill(key, None)
        with torch.inference_mode(), runner.context.bind(padded):
            hidden = runner.model(padded.input_ids, padded.positions, padded)
        assert torch.isfinite(hidden).all()
    for cache, old in zip(runner.kv_caches, before):
        assert torch.equal(cache[DUMMY_PAGE + 1:], old)
    assert all(torch.isfinite(c[DUMMY_PAGE]).all() for c in runner.kv_caches)


def test_a_step_built_on_the_device_cannot_be_padded(history):
    engine, batches = history
    key = PADDED_KEYS["DECODE"]
    batch = dataclasses.replace(batches["DECODE"], input_ids_cpu=None)
    with pytest.raises(ValueError, match="built on the device"):
        buffers_for(engine, key).fill(key, batch)


def decode_step(tables: list[list[int]], page_size: int = 4):
    """A DECODE step of one token a row at each row's last page (host lists as ``pack_batch`` makes them)."""
    positions = [len(t) * page_size - 1 for t in tables]
    slots = [t[-1] * page_size + page_size - 1 for t in tables]
    return pack_batch(0, 1, page_size, [1] * len(tables), positions, slots, [p + 1 for p in positions], positions,
                      list(range(len(tables) + 1)), tables, list(range(len(tables))), "cpu")


def test_page_table_holds_each_rows_pages_then_the_dummy_page_and_writes_only_changes():
    """Row by row, the static table is the step's pages and then the dummy page, as a step's table
    promises; what a row already holds is not written again. The tables are the KV manager's own
    lists, which grow after the step: the buffers remember a copy of what they wrote, not the lists."""
    buffers = StepBuffers(8, 4, 6, 4, torch.device("cpu"), full_page_table=True)
    key = GraphKey(0, 1, 4, 4)
    writes = []
    table_writes = buffers._table_writes
    buffers._table_writes = lambda rows: writes.append(table_writes(rows)) or writes[-1]

    def check(tables):
        table = buffers.fill(key, decode_step(tables)).page_table
        want = [t + [DUMMY_PAGE] * (6 - len(t)) for t in tables + [[]] * (4 - len(tables))]
        assert table.tolist() == want
        return writes[-1]

    live = [[5, 6], [7], [8, 9, 10]]
    assert check(live) == ([0, 1, 6, 12, 13, 14], [5, 6, 7, 8, 9, 10])
    assert check(live) == ([], [])  # unchanged: nothing written
    live[1].append(11)  # a row's new page: that entry alone
    assert check(live) == ([6 + 1], [11])
    check([[7, 11], [8, 9, 10]])  # the first request finished: rows move up, a shorter row clears its tail
    check([[3, 4, 12, 13, 14, 15], [7, 11], [8, 9, 10], [2]])  # a full row, and every row used
    check([])  # all padding
    with pytest.raises(ValueError, match="row 1 has 7 pages"):
        table_writes([[1], [1] * 7])
    assert check([[1]]) == ([0], [1])  # the refused rows were not taken as written


def test_a_table_of_odd_size_fills():
    """Rows × pages odd (3 × 5): the buffers' room for page-table writes is still whole int64s, and a
    step that writes every entry puts each in place."""
    buffers = StepBuffers(8, 3, 5, 4, torch.device("cpu"), full_page_table=True)
    tables = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    assert buffers.fill(GraphKey(0, 1, 3, 3), decode_step(tables)).page_table.tolist() == tables
