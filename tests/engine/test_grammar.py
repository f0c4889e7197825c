"""Grammar specs, compile pool and the mask walk over drafts, checked against fresh matchers."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from encore.engine.grammar import (GrammarCompilerPool, RequestGrammar, allocate_bitmask, apply_bitmask,
                                   grammar_spec)

VOCAB = 320


@pytest.fixture(scope="module")
def pool(v3_dir):
    pool = GrammarCompilerPool(AutoTokenizer.from_pretrained(v3_dir), VOCAB, [1])
    yield pool
    pool.shutdown()


def allowed(bitmask_row: torch.Tensor) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, bitmask_row[None])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_specs_validate_and_reject_with_xgrammar_messages():
    assert grammar_spec(None, None, None, False) is None
    assert grammar_spec({"type": "object", "properties": {"b": {}, "a": {}}}, None, None, False).source == (
        '{"type": "object", "properties": {"b": {}, "a": {}}}')
    with pytest.raises(ValueError, match=r"at most one of .* got \['ebnf', 'regex'\]"):
        grammar_spec(None, "a+", "root ::= \"a\"", False)
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        grammar_spec(None, "", None, False)
    with pytest.raises(ValueError, match="invalid regex: Regex parsing error"):
        grammar_spec(None, "a(", None, False).parse()
    with pytest.raises(ValueError, match="invalid ebnf: EBNF parser error"):
        grammar_spec(None, None, "root ::= ", False).parse()
    with pytest.raises(ValueError, match="json_schema is not valid JSON: Extra data"):
        grammar_spec('{},"]', None, None, False)
    with pytest.raises(ValueError, match="invalid json_schema"):
        grammar_spec('{"type": 5}', None, None, False).parse()


def test_identical_sources_share_one_compilation(pool):
    a = pool.submit(grammar_spec(None, "(yes|no)", None, False))
    b = pool.submit(grammar_spec(None, "(yes|no)", None, False))
    assert a is b and a.result(timeout=30) is not None


def test_draft_walk_fills_each_row_as_a_fresh_matcher_would_and_rolls_back(pool, v3_dir):
    tok = AutoTokenizer.from_pretrained(v3_dir)
    spec = grammar_spec(None, "(fox|dog) (jumps|over)", None, False)
    compiled = pool.submit(spec).result(timeout=30)
    g = RequestGrammar(pool.submit(spec))
    g.future.result(timeout=30)
    assert g.ready()
    good = tok.encode("fox jumps")
    bitmask = allocate_bitmask(len(good) + 1, VOCAB)
    assert g.fill(bitmask, 0, good) == len(good)
    for i in range(len(good) + 1):
        fresh = xgr.GrammarMatcher(compiled)
        for t in good[:i]:
            assert fresh.accept_token(t)
        want = allocate_bitmask(1, VOCAB)
        fresh.fill_next_token_bitmask(want, 0)
        assert allowed(bitmask[i]) == allowed(want[0]), i
    # The walk rolled back: the matcher still stands at the start.
    first = allocate_bitmask(1, VOCAB)
    g.matcher.fill_next_token_bitmask(first, 0)
    assert allowed(first[0]) == allowed(bitmask[0])
    # A draft the grammar rejects stops the walk there.
    bad = good[:1] + tok.encode("!")
    fresh_mask = allocate_bitmask(len(bad) + 1, VOCAB)
    assert g.fill(fresh_mask, 0, bad) == 1
    assert tok.encode("!")[0] not in allowed(fresh_mask[1])


def test_accept_reports_termination(pool, v3_dir):
    tok = AutoTokenizer.from_pretrained(v3_dir)
    g = RequestGrammar(pool.submit(grammar_spec(None, "fox", None, False)))
    g.future.result(timeout=30)
    assert g.ready()
    assert g.accept(tok.encode("fox")) is False and g.matcher.is_completed()
    assert g.accept([1]) is True  # the stop token ends the grammar
    other = RequestGrammar(g.future)
    assert other.ready()
    with pytest.raises(RuntimeError, match="sampled against the grammar"):
        other.accept(tok.encode("dog"))
