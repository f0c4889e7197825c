"""Padding a step to its key: the layout, and that padding never changes a real token's result or
touches anything but the dummy page."""

from __future__ import annotations

import pytest
import torch

from encore.engine.kv_cache import DUMMY_PAGE
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


def test_full_page_table_keeps_its_width(history):
    engine, batches = history
    key = PADDED_KEYS["DECODE"]
    padded = buffers_for(engine, key, full=True).fill(key, batches["DECODE"])
    assert padded.page_table.shape == (4, engine.runner.max_pages_per_row)


@pytest.mark.parametrize("mode", ["EXTEND", "DECODE", "MIXED"])
def test_padded_step_gives_real_tokens_the_same_hidden_states(mode, history):
    engine, batches = history
    batch, key = batches[mode], PADDED_KEYS[mode]
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
    for key in PADDED_KEYS.values():
        padded = buffers_for(engine, key).fill(key, None)
        with torch.inference_mode(), runner.context.bind(padded):
            hidden = runner.model(padded.input_ids, padded.positions, padded)
        assert torch.isfinite(hidden).all()
    for cache, old in zip(runner.kv_caches, before):
        assert torch.equal(cache[DUMMY_PAGE + 1:], old)
    assert all(torch.isfinite(c[DUMMY_PAGE]).all() for c in runner.kv_caches)
