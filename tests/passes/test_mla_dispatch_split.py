"""MLA dispatch split: per key, the prefill branch, the decode branch, or both."""

from __future__ import annotations

import pytest
import torch

from encore.graphs.keys import GraphKey
from encore.passes.mla_dispatch_split import MlaDispatchSplit
from graph_helpers import PADDED_KEYS, rel_err, run_pipeline

ATTN, PREFILL, DECODE = "encore.mla_attention.default", "encore.mla_prefill.default", "encore.mla_decode.default"
CAT, EMPTY = "aten.cat.default", "aten.empty.memory_format"

# mode -> (prefill ops, decode ops, cats) per layer after the split
EXPECTED = {"EXTEND": (1, 0, 0), "DECODE": (0, 1, 0), "MIXED": (1, 1, 1)}


@pytest.mark.parametrize("kind, mode", [("v2_lite", "EXTEND"), ("v2_lite", "DECODE"), ("v2_lite", "MIXED"),
                                        ("v3", "EXTEND"), ("v3", "DECODE"), ("v3", "MIXED")])
def test_each_key_gets_only_its_branches(kind, mode, pipeline):
    run, layers = pipeline(kind, mode)
    stage = run.stages["MlaDispatchSplit"]
    assert stage.matches == layers
    before, after = stage.counts_before, stage.counts_after
    assert (before[ATTN], before[PREFILL], before[DECODE], before[CAT]) == (layers, 0, 0, 0)
    prefill, decode, cats = EXPECTED[mode]
    assert (after[ATTN], after[PREFILL], after[DECODE], after[CAT]) == (0, prefill * layers, decode * layers,
                                                                      cats * layers)
    assert after[EMPTY] == before[EMPTY] + cats * layers  # MIXED: one buffer per branch instead of one
    assert rel_err(stage.hidden, run.eager) < 1e-5


def test_mixed_prefill_branch_covers_exactly_the_key_prefill_tokens(pipeline):
    run, _ = pipeline("v2_lite", "MIXED")
    key = PADDED_KEYS["MIXED"]
    sizes = {str(n.target): n.args[0].meta["val"].shape[0] for n in run.stages["MlaDispatchSplit"].after.nodes
             if str(n.target) in (PREFILL, DECODE)}
    assert sizes == {PREFILL: key.num_extend_tokens, DECODE: key.num_decodes * key.q_len_per_req}


def test_graph_of_another_key_is_refused(history):
    engine, batches = history("v3")
    wrong = GraphKey(0, 1, 8, 8)  # the graph below is traced for 4 tokens
    with pytest.raises(Exception, match="mla_attention over 4 tokens in a graph for key"):
        run_pipeline(engine, batches["DECODE"], PADDED_KEYS["DECODE"], [MlaDispatchSplit(wrong)])


def test_does_not_fire_without_attention():
    split = MlaDispatchSplit(GraphKey(0, 1, 2, 2))
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph
    split(graph)
    assert split.matches == 0
