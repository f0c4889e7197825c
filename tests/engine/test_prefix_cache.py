"""Prefix caching: requests that share leading tokens start from each other's KV pages, with the same
greedy tokens (and, with a model drafter, the same drafts) as without the cache, and no page leaks."""

from __future__ import annotations

import pytest

from encore.engine import Engine, SamplingParams

PAGE = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a careful Python programmer. Answer with code only.\n"
QUESTIONS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, item):\n",
             "for i in range(10):\n    print(i)\n"]
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_hit(prompt: list[int], cached: list[int], next_token: bool) -> int:
    """Whole pages of ``prompt`` found among ``cached`` (a finished request's computed tokens), leaving
    at least the last prompt token to compute; with ``next_token`` a page also needs the token after it."""
    shared = common_prefix(prompt, cached) - (1 if next_token else 0)
    return max(0, min(shared, len(prompt) - 1)) // PAGE * PAGE


def waves(engine: Engine, prompts: list):
    """The first prompt alone, then all of them at once: the second wave finds the first's pages, and
    its own first prompt finds every page it may take."""
    first = engine.generate(prompts[:1], GREEDY)
    return first, engine.generate(prompts, GREEDY)


@pytest.mark.parametrize("speculative", [None, MTP], ids=["plain", "mtp"])
def test_shared_prefix_comes_from_the_cache_with_the_same_tokens(speculative):
    on = Engine(device="cpu", page_size=PAGE, speculative=speculative)
    off = Engine(device="cpu", page_size=PAGE, speculative=speculative, enable_prefix_caching=False)
    # The shared part ends on a page boundary, the questions differ from their first token: a drafter's
    # KV in the last shared slot was computed from the first question's token, so it is not shared.
    shared = on.tokenizer.encode(SYSTEM)[:4 * PAGE]
    prompts = [shared + on.tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
    (first_on,), second_on = waves(on, prompts)
    (first_off,), second_off = waves(off, prompts)

    assert first_on.token_ids == first_off.token_ids and first_on.num_cached_tokens == 0
    cached = first_on.prompt_token_ids + first_on.token_ids[:-1]  # the KV the first request computed
    for got, want in zip(second_on, second_off):
        assert got.token_ids == want.token_ids
        # The drafter's KV from the cache is what it would have computed: the same drafts are accepted.
        assert got.num_accepted_tokens == want.num_accepted_tokens
        assert got.num_cached_tokens == expected_hit(got.prompt_token_ids, cached, speculative is not None)
        assert want.num_cached_tokens == 0
    assert second_on[1].num_cached_tokens > 0  # the system prompt spans several pages
    stats = on.stats()
    assert stats["prefix_cache_hit_tokens"] == sum(o.num_cached_tokens for o in second_on)
    assert stats["prefix_cache_query_tokens"] == sum(len(o.prompt_token_ids) for o in [first_on, *second_on])
    assert 0 < stats["kv_pages_cached"] and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert off.stats()["kv_pages_cached"] == off.stats()["prefix_cache_hit_tokens"] == 0
    if speculative is not None:
        assert stats["spec_accepted_tokens"] == off.stats()["spec_accepted_tokens"] > 0


def test_a_next_turn_reuses_the_previous_answer():
    on = Engine(device="cpu", page_size=PAGE)
    off = Engine(device="cpu", page_size=PAGE, enable_prefix_caching=False)
    turn = on.generate([SYSTEM + QUESTIONS[0]], GREEDY)[0]
    follow_up = turn.prompt_token_ids + turn.token_ids + on.tokenizer.encode("\n# now iteratively\n")
    got, want = on.generate([follow_up], GREEDY)[0], off.generate([follow_up], GREEDY)[0]
    assert got.token_ids == want.token_ids
    # Every page the first turn filled, its answer's too (all but the last answer token have KV).
    assert got.num_cached_tokens == expected_hit(follow_up, turn.prompt_token_ids + turn.token_ids[:-1], False)
    assert got.num_cached_tokens > len(turn.prompt_token_ids)


def test_idle_pages_are_evicted_oldest_first_when_memory_is_needed():
    # 15 usable pages of 4 tokens: two ~20-token prompts' pages cannot all stay cached.
    on = Engine(device="cpu", page_size=PAGE, num_kv_pages=16, max_num_seqs=2)
    off = Engine(device="cpu", page_size=PAGE, enable_prefix_caching=False)
    prompts = [f"# task {i}\n" + QUESTIONS[i % len(QUESTIONS)] for i in range(6)]
    for prompt in prompts:
        got = on.generate([prompt], GREEDY)[0]
        assert got.token_ids == off.generate([prompt], GREEDY)[0].token_ids
        stats = on.stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["kv_pages_cached"] <= 15
    assert on.generate([prompts[-1]], GREEDY)[0].num_cached_tokens > 0  # the newest stays
    assert on.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 0  # the oldest went first


def test_preempted_requests_resume_from_their_own_pages():
    # 13 usable pages cannot hold four requests: some are preempted and recompute from the cache.
    prompts = [SYSTEM + q for q in QUESTIONS]
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    on = Engine(device="cpu", page_size=PAGE, num_kv_pages=30, chunked_prefill_size=8, max_num_batched_tokens=16)
    off = Engine(device="cpu", page_size=PAGE, enable_prefix_caching=False)
    outs = on.generate(prompts, long)
    stats = on.stats()
    assert stats["preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > sum(o.num_cached_tokens for o in outs)  # re-admissions hit too
    for got, prompt in zip(outs, prompts):
        assert got.token_ids == off.generate([prompt], long)[0].token_ids
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


@pytest.mark.parametrize("speculative", [None, MTP], ids=["plain", "mtp"])
def test_a_cold_burst_behind_one_system_prompt_computes_it_once(speculative):
    on = Engine(device="cpu", page_size=PAGE, speculative=speculative)
    off = Engine(device="cpu", page_size=PAGE, speculative=speculative, enable_prefix_caching=False)
    shared = on.tokenizer.encode(SYSTEM)  # 4 * PAGE and more
    alone = on.tokenizer.encode("import numpy as np\n")  # shares nothing: never held back
    prompts = [shared + on.tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS] + [alone]
    got, want = on.generate(prompts, GREEDY), off.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.num_accepted_tokens for o in got] == [o.num_accepted_tokens for o in want]
    # The first prompt computes the shared pages; the others wait for them and take all of them.
    pages = expected_hit(prompts[1], prompts[0], speculative is not None)
    assert got[0].num_cached_tokens == 0 and pages >= 4 * PAGE
    assert [o.num_cached_tokens for o in got[1:-1]] == [pages] * (len(QUESTIONS) - 1)
    assert got[-1].num_cached_tokens == 0
    stats = on.stats()
    assert stats["prefix_cache_deferrals"] > 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert off.stats()["prefix_cache_deferrals"] == 0


def test_held_back_requests_do_not_hold_back_the_queue():
    """The queue behind a waiting follower is admitted in the same step as its leader."""
    engine = Engine(device="cpu", page_size=PAGE)
    shared = engine.tokenizer.encode(SYSTEM)
    engine.add_request("leader", shared + [5], GREEDY)
    engine.add_request("follower", shared + [6], GREEDY)
    engine.add_request("other", [7, 8, 9], GREEDY)
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"leader", "other"} and [r.request_id for r in engine.scheduler.waiting] == ["follower"]
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs["follower"].num_cached_tokens == expected_hit(shared + [6], shared + [5], False) > 0
