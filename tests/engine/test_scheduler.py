"""Scheduler rules: decode rows first, prefill chunks fill the rest, step layout order."""

from __future__ import annotations

import pytest

from encore.backends.metadata import ForwardMode
from encore.engine.detokenizer import IncrementalDetokenizer
from encore.engine.kv_cache import KVCacheManager
from encore.engine.request import Request, RequestStatus
from encore.engine.sampling_params import SamplingParams
from encore.engine.scheduler import Scheduler
from encore.engine.step import build_forward_batch


def request(rid: str, prompt_len: int, generated: int = 0) -> Request:
    req = Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(), 0, IncrementalDetokenizer(None, [], ()))
    req.token_ids.extend([3] * generated)
    return req


def decoding(sched: Scheduler, rid: str, prompt_len: int) -> Request:
    """A running request that has produced one token and now decodes."""
    req = request(rid, prompt_len, generated=1)
    req.num_computed = prompt_len
    req.status = RequestStatus.RUNNING
    assert sched.kv.reserve(rid, prompt_len)
    sched.running.append(req)
    return req


def make(budget=16, chunk=6, pages=64, mixed=True, max_seqs=8) -> Scheduler:
    return Scheduler(KVCacheManager(pages, 4), budget, chunk, max_seqs, mixed)


def test_decodes_claim_budget_first_then_prefill_chunks_fill_the_rest():
    sched = make(budget=10, chunk=6)
    d1, d2 = decoding(sched, "d1", 5), decoding(sched, "d2", 7)
    w1, w2 = request("w1", 20), request("w2", 3)
    sched.add(w1)
    sched.add(w2)
    step = sched.schedule()
    assert step.decodes == [d1, d2]
    assert step.extends == [(w1, 6), (w2, 2)]  # 10 - 2 decode tokens = 8: a full chunk, then the rest


def test_step_layout_prefill_rows_first_and_gather_ids():
    sched = make(budget=32, chunk=4)
    d = decoding(sched, "d", 6)
    long, short = request("long", 10), request("short", 3)
    sched.add(long)
    sched.add(short)
    step = sched.schedule()
    batch, sampled = build_forward_batch(step, sched.kv, "cpu")
    assert batch.mode is ForwardMode.MIXED and batch.num_extends == 2 and batch.bs == 3
    assert batch.qo_indptr.tolist() == [0, 4, 7, 8]
    assert batch.input_ids.tolist() == long.token_ids[:4] + short.token_ids + [d.token_ids[-1]]
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 6]
    # "long" is a partial chunk: no logits row; "short" completes its prompt; the decode row samples.
    assert batch.gather_ids.tolist() == [6, 7] and sampled == [short, d]
    assert batch.seq_lens.tolist() == [4, 3, 7] and batch.prefix_lens.tolist() == [0, 0, 6]
    table = sched.kv.table("d")
    assert batch.slot_mapping.tolist()[-1] == table[1] * 4 + 2


def test_spec_rows_reserve_one_plus_k_tokens():
    sched = make()
    d = decoding(sched, "d", 8)  # exactly 2 pages
    d.draft_token_ids = [21, 22, 23]
    step = sched.schedule(q_len_per_req=4)
    assert step.decodes == [d] and len(sched.kv.table("d")) == 3  # 8 + 4 slots
    batch, sampled = build_forward_batch(step, sched.kv, "cpu")
    assert batch.input_ids.tolist() == [3, 21, 22, 23] and batch.positions.tolist() == [8, 9, 10, 11]
    assert sampled == [d] * 4 and batch.gather_ids.tolist() == [0, 1, 2, 3]


def test_a_spec_row_short_of_drafts_is_refused_by_name():
    sched = make()
    d = decoding(sched, "d", 8)
    d.draft_token_ids = [21, 22]
    step = sched.schedule(q_len_per_req=4)
    with pytest.raises(ValueError, match="decode row 'd' has 2 draft tokens; q_len_per_req 4 needs 3"):
        build_forward_batch(step, sched.kv, "cpu")


def test_non_mixed_mode_prefills_first_then_decodes():
    sched = make(mixed=False)
    d = decoding(sched, "d", 5)
    w = request("w", 5)
    sched.add(w)
    first = sched.schedule()
    assert first.extends == [(w, 5)] and not first.decodes
    w.num_computed = 5
    w.token_ids.append(4)
    second = sched.schedule()
    assert not second.extends and second.decodes == [d, w]


def test_waiting_request_that_cannot_get_pages_blocks_later_ones():
    sched = make(pages=4, chunk=16, budget=32)  # 3 usable pages = 12 tokens
    big, small = request("big", 14), request("small", 2)
    sched.add(big)
    sched.add(small)
    step = sched.schedule()
    assert step.empty and list(sched.waiting) == [big, small]


def test_decode_preempts_newest_running_request_when_pages_run_out():
    sched = make(pages=4, budget=32)  # 3 usable pages
    old = decoding(sched, "old", 4)  # 1 page, next token needs a second
    new = decoding(sched, "new", 8)  # 2 pages
    step = sched.schedule()
    assert step.preempted == [new] and step.decodes == [old]
    assert new.num_computed == 0 and sched.waiting[0] is new and not sched.kv.table("new")


def test_max_num_seqs_limits_admission():
    sched = make(max_seqs=2)
    for i in range(3):
        sched.add(request(f"w{i}", 2))
    step = sched.schedule()
    assert [r.request_id for r, _ in step.extends] == ["w0", "w1"] and len(sched.waiting) == 1
