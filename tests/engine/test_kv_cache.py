"""Page pool and KV reservation: exact page counts, all-or-nothing, no double use, no leak."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encore.engine import Engine, SamplingParams
from encore.engine.kv_cache import DUMMY_PAGE, KVCacheManager, PagePool, zeroed_pool


def check_invariants(kv: KVCacheManager) -> None:
    """Only a page of the prefix cache is shared, each page's refcount is its number of owners, and
    every page is owned, free or idle in the cache, exactly once."""
    owners = Counter(p for table in kv.tables.values() for p in table)
    pool = kv.pool
    assert all(n == 1 or p in pool.registered for p, n in owners.items()), "an unregistered page is owned twice"
    assert all(pool.refcount[p] == n for p, n in owners.items()), "a refcount is not its number of owners"
    free = pool.free_pages + list(pool.idle)
    assert DUMMY_PAGE not in owners and DUMMY_PAGE not in free
    assert len(free) == len(set(free))
    assert not set(owners) & set(free), "an owned page is also free"
    assert len(owners) + kv.num_free_pages == kv.num_total_pages, "pages leaked"
    assert set(pool.idle) <= set(pool.registered) and not set(pool.free_pages) & set(pool.registered)
    assert all(pool.index[key] == p for p, (key, _) in pool.registered.items())
    assert len(pool.index) == len(pool.registered)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_reserve_allocates_exactly_the_pages_a_length_needs(page_size):
    kv = KVCacheManager(num_pages=64, page_size=page_size)
    for tokens in (1, page_size - 1, page_size, page_size + 1, 2 * page_size, 3 * page_size + 1):
        if tokens < 1:
            continue
        assert kv.reserve("r", tokens)
        assert len(kv.table("r")) == -(-tokens // page_size), tokens
    # A decode row with k = 3 drafts at a page boundary: seq_len 2 * page_size needs 1 + 3 more slots.
    kv.free("r")
    assert kv.reserve("r", 2 * page_size) and kv.reserve("r", 2 * page_size + 4)
    assert len(kv.table("r")) == -(-(2 * page_size + 4) // page_size)
    kv.trim("r", 2 * page_size)
    assert len(kv.table("r")) == 2
    check_invariants(kv)


def test_reserve_is_all_or_nothing():
    kv = KVCacheManager(num_pages=5, page_size=4)  # 4 usable pages
    assert kv.reserve("a", 9)  # 3 pages
    assert not kv.reserve("b", 8)  # needs 2, only 1 free: takes none
    assert "b" not in kv.tables and kv.num_free_pages == 1
    assert not kv.reserve("a", 17)  # needs 2 more
    assert len(kv.table("a")) == 3
    check_invariants(kv)


def test_pool_rejects_double_release_and_dummy_page():
    pool = PagePool(4)
    pages = pool.alloc(3)
    assert DUMMY_PAGE not in pages and pool.alloc(1) is None
    pool.incref(pages[:1])
    pool.release(pages)
    assert pool.num_free == 2
    pool.release(pages[:1])
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.release(pages[:1])
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(1)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 14), st.integers(1, 9)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
), min_size=1, max_size=25)


@pytest.fixture(scope="module")
def small_engine(v3_dir):
    # 10 usable pages of 4 tokens: pressure enough for preemption; page-size multiples are common.
    return Engine(str(v3_dir), device="cpu", page_size=4, num_kv_pages=11, chunked_prefill_size=5,
                  max_num_batched_tokens=10)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_no_page_owned_twice_and_no_leak_under_any_mix(small_engine, ops):
    run_ops(small_engine, ops, lambda a, b: (list(range(2, 2 + a)),
                                             SamplingParams(max_tokens=b, temperature=0.0, ignore_eos=True)))


def run_ops(engine, ops, request) -> None:
    """Applies ``ops`` — ("add", a, b, *rest): add the request ``request(a, b, *rest)`` returns as
    (prompt, params); ("step", a, ...): a steps; ("abort", a, ...): abort an added request — checking
    the pool's invariants and that running rows' pages hold their computed tokens after each, then
    runs the engine dry: every page must be free again."""
    ids = []
    for op, a, b, *rest in ops:
        if op == "add":
            ids.append(f"q{len(ids)}")
            engine.add_request(ids[-1], *request(a, b, *rest))
        elif op == "step":
            for _ in range(a):
                engine.step()
        elif ids:
            engine.abort(ids[a % len(ids)])
        check_invariants(engine.kv)
        for req in engine.scheduler.running:
            assert len(engine.kv.table(req.request_id)) * engine.config.page_size >= req.num_computed
    while engine.has_unfinished_requests():
        engine.step()
        check_invariants(engine.kv)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    assert not engine.requests


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the RSS from /proc")
def test_a_cpu_pool_is_zero_and_takes_memory_only_where_written():
    before = _rss_bytes()
    pool = zeroed_pool((4096, 64, 512), torch.bfloat16, torch.device("cpu"))  # 256 MiB
    assert pool.shape == (4096, 64, 512) and pool.dtype == torch.bfloat16
    assert _rss_bytes() - before < 16 << 20
    assert not pool[::97].any()  # read across the pool: still no memory taken
    pool[5, 3] = 1.5
    assert _rss_bytes() - before < 16 << 20
    assert pool[5, 3].eq(1.5).all() and int(pool.count_nonzero()) == 512
