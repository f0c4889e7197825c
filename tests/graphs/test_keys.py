"""Graph keys: which keys the buckets make, and which key a step runs on."""

from __future__ import annotations

import pytest

from encore.backends.metadata import ForwardMode
from encore.graphs.keys import GraphKey, KeyTable, build_keys


class Step:
    """The fields of a ForwardBatch a key looks at."""

    def __init__(self, num_extends: int, extend_tokens: int, num_decodes: int, q_len: int = 1) -> None:
        self.num_extends = num_extends
        self.q_len_per_req = q_len
        self.bs = num_extends + num_decodes
        self.num_decodes = num_decodes
        self.num_extend_tokens = extend_tokens
        self.num_tokens = extend_tokens + num_decodes * q_len
        self.mode = ForwardMode.of(num_extends, self.bs)


def test_buckets_make_decode_mixed_and_extend_keys_within_the_budget():
    keys = build_keys(decode_sizes=(1, 2, 64), q_lens=(1, 3), mixed_extends=(1,), mixed_decode_sizes=(4,),
                      prefill_tokens=(8, 128), extend_sizes=(1, 2), max_tokens=130, max_rows=32)
    decode = {k for k in keys if k.mode is ForwardMode.DECODE}
    assert decode == {GraphKey(0, 1, 1, 1), GraphKey(0, 1, 2, 2), GraphKey(0, 1, 32, 32),  # 64 rows capped at 32
                      GraphKey(0, 3, 1, 3), GraphKey(0, 3, 2, 6), GraphKey(0, 3, 32, 96)}
    mixed = {k for k in keys if k.mode is ForwardMode.MIXED}
    assert mixed == {GraphKey(1, 1, 5, 12), GraphKey(1, 3, 5, 20)}  # the 128-token bucket exceeds the budget
    extend = {k for k in keys if k.mode is ForwardMode.EXTEND}
    assert extend == {GraphKey(1, 1, 1, 8), GraphKey(2, 1, 2, 8), GraphKey(1, 1, 1, 128), GraphKey(2, 1, 2, 128)}
    assert [k.num_tokens for k in keys] == sorted((k.num_tokens for k in keys), reverse=True)  # largest first


def test_keys_cap_their_decode_rows_at_the_row_budget():
    keys = build_keys(decode_sizes=(4, 64), q_lens=(1,), mixed_extends=(1, 16, 48), mixed_decode_sizes=(4, 64),
                      prefill_tokens=(32,), extend_sizes=(16, 64), max_tokens=1000, max_rows=48)
    assert {k for k in keys if k.mode is ForwardMode.DECODE} == {GraphKey(0, 1, 4, 4), GraphKey(0, 1, 48, 48)}
    # A MIXED step has at most 47 decode rows, and at most 47 prefill rows (more than a 32-token bucket holds).
    assert {k for k in keys if k.mode is ForwardMode.MIXED} == {
        GraphKey(1, 1, 5, 36), GraphKey(1, 1, 48, 32 + 47), GraphKey(16, 1, 20, 36), GraphKey(16, 1, 63, 32 + 47)}
    assert {k for k in keys if k.mode is ForwardMode.EXTEND} == {GraphKey(16, 1, 16, 32)}  # 48 rows: over 32 tokens


def test_keys_cap_their_prefill_rows_at_the_row_budget():
    """A burst as large as the row budget allows finds a key: prefill buckets past the budget are
    capped (MIXED at one row less, for its decode row), not dropped."""
    keys = build_keys(decode_sizes=(8,), q_lens=(1,), mixed_extends=(1, 16, 64), mixed_decode_sizes=(4,),
                      prefill_tokens=(128,), extend_sizes=(1, 16, 64), max_tokens=1000, max_rows=8)
    assert {k for k in keys if k.mode is ForwardMode.MIXED} == {GraphKey(1, 1, 5, 132), GraphKey(7, 1, 11, 132)}
    assert {k for k in keys if k.mode is ForwardMode.EXTEND} == {GraphKey(1, 1, 1, 128), GraphKey(8, 1, 8, 128)}
    table = KeyTable(keys)
    assert table.find(Step(7, 100, 1)) == GraphKey(7, 1, 11, 132)
    assert table.find(Step(8, 100, 0)) == GraphKey(8, 1, 8, 128)
    assert not {k for k in build_keys(decode_sizes=(1,), q_lens=(1,), mixed_extends=(16,), mixed_decode_sizes=(4,),
                                      prefill_tokens=(128,), extend_sizes=(), max_tokens=1000, max_rows=1)
                if k.mode is ForwardMode.MIXED}  # one row: no step has both kinds


def test_the_largest_mixed_bucket_holds_every_step_within_the_row_budget():
    rows, extends = 64, 16
    table = KeyTable(build_keys(decode_sizes=(64,), q_lens=(1, 3), mixed_extends=(1, extends),
                                mixed_decode_sizes=(4, 16, 64), prefill_tokens=(128,), extend_sizes=(16,),
                                max_tokens=1000, max_rows=rows))
    for q in (1, 3):
        for e in range(1, extends + 1):
            for d in range(1, rows - e + 1):
                key = table.find(Step(e, 100, d, q_len=q))
                assert key is not None and key.mode is ForwardMode.MIXED, (e, d, q)
    assert table.find(Step(2, 100, 60)) == GraphKey(16, 1, 16 + 63, 128 + 63)  # 14 padded rows past the budget


def test_step_runs_on_the_smallest_key_of_its_mode_that_holds_it():
    table = KeyTable([GraphKey(0, 1, 4, 4), GraphKey(0, 1, 8, 8), GraphKey(1, 1, 5, 12), GraphKey(1, 1, 9, 40),
                      GraphKey(1, 1, 1, 8), GraphKey(0, 3, 4, 12)])
    assert table.find(Step(0, 0, 3)) == GraphKey(0, 1, 4, 4)
    assert table.find(Step(0, 0, 5)) == GraphKey(0, 1, 8, 8)
    assert table.find(Step(0, 0, 9)) is None  # more decode rows than any key
    assert table.find(Step(0, 0, 2, q_len=3)) == GraphKey(0, 3, 4, 12)
    assert table.find(Step(0, 0, 2, q_len=2)) is None  # no key with that q_len
    assert table.find(Step(1, 6, 3)) == GraphKey(1, 1, 5, 12)
    assert table.find(Step(1, 9, 3)) == GraphKey(1, 1, 9, 40)  # prefill tokens past the small bucket
    assert table.find(Step(2, 6, 3)) is None  # more prefill rows than any MIXED key
    assert table.find(Step(1, 5, 0)) == GraphKey(1, 1, 1, 8)  # EXTEND never runs on a MIXED key


def test_prefill_rows_pad_up_to_the_key_with_a_token_each():
    table = KeyTable([GraphKey(1, 1, 5, 12), GraphKey(4, 1, 8, 36), GraphKey(4, 1, 4, 16)])
    assert table.find(Step(1, 6, 3)) == GraphKey(1, 1, 5, 12)  # the fewest padded rows first
    assert table.find(Step(2, 30, 3)) == GraphKey(4, 1, 8, 36)  # 30 tokens + 2 padded rows' = the bucket's 32
    assert table.find(Step(2, 31, 3)) is None  # no token left for the second padded row
    assert table.find(Step(4, 32, 4)) == GraphKey(4, 1, 8, 36)
    assert table.find(Step(5, 20, 1)) is None
    assert table.find(Step(3, 15, 0)) == GraphKey(4, 1, 4, 16)
    assert table.find(Step(3, 16, 0)) is None


@pytest.mark.parametrize("fields, message", [
    ((3, 1, 2, 8), "num_extends <= bs"),
    ((0, 0, 2, 2), "q_len_per_req must be >= 1"),
    ((2, 1, 3, 2), "leaves 1 prefill tokens for 2 prefill rows"),
])
def test_bad_keys_are_refused_with_the_reason(fields, message):
    with pytest.raises(ValueError, match=message):
        GraphKey(*fields)


def test_speculative_decoding_adds_verify_keys():
    """Every decode row of a speculative engine verifies 1 + k tokens: by default it gets verify keys
    alone; q_lens asked for are kept."""
    from encore.engine.config import EngineConfig
    from encore.graphs.keys import keys_for

    options = dict(model="m", device="cpu", speculative={"method": "ngram", "num_speculative_tokens": 3},
                   graph_decode_sizes=(2,), graph_mixed_extends=(), graph_extend_sizes=())
    assert set(keys_for(EngineConfig(**options))) == {GraphKey(0, 4, 2, 8)}
    assert set(keys_for(EngineConfig(**options, graph_q_lens=(1,)))) == {GraphKey(0, 1, 2, 2), GraphKey(0, 4, 2, 8)}
    assert EngineConfig(model="m", device="cpu").graph_q_lens == (1,)


@pytest.mark.parametrize("max_num_seqs", [1, 7, 64, 100, 256, 512])
@pytest.mark.parametrize("k", [0, 2])
def test_default_buckets_key_every_decode_and_mixed_step_the_row_budget_allows(max_num_seqs, k):
    """With the default decode sizes no decode step (of 1 token a row, or of 1 + k with k drafts), and
    no prompt step of one prefill row riding along running decodes, falls past the keys (a step no key
    holds launches kernel by kernel); padding stays under half the key's rows past 8 decode rows,
    under a third past 64."""
    from encore.engine.config import EngineConfig
    from encore.graphs.keys import keys_for

    spec = {"method": "ngram", "num_speculative_tokens": k} if k else None
    table = KeyTable(keys_for(EngineConfig(model="m", device="cpu", max_num_seqs=max_num_seqs, speculative=spec)))
    assert {key.q_len_per_req for key in table.keys if key.num_decodes} == {1 + k}
    q_len = 1 + k
    for rows in range(1, max_num_seqs + 1):
        key = table.find(Step(0, 0, rows, q_len))
        assert key is not None and key.q_len_per_req == q_len, rows
        assert rows <= 8 or rows > key.bs / 2, (rows, key)
        assert rows <= 64 or rows > key.bs * 2 / 3, (rows, key)
        if rows < max_num_seqs:
            assert table.find(Step(1, 100, rows, q_len)) is not None, rows
