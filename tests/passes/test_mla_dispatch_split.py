"""MLA dispatch split: per family, the prefill branch, the decode branch, or both, split at the
step's symbolic prefill-token count."""

from __future__ import annotations

import pytest
import torch

from encore.backends.metadata import ForwardMode
from encore.graphs.compiler import NUM_EXTEND_TOKENS
from encore.passes.mla_dispatch_split import MlaDispatchSplit
from encore.passes.fx_utils import step_size
from graph_helpers import PADDED_KEYS, rel_err, run_pipeline

ATTN, PREFILL, DECODE = "encore.mla_attention.default", "encore.mla_prefill.default", "encore.mla_decode.default"
CAT, EMPTY = "aten.cat.default", "aten.empty.memory_format"

# mode -> (prefill ops, decode ops, cats) per layer after the split
EXPECTED = {"EXTEND": (1, 0, 0), "DECODE": (0, 1, 0), "MIXED": (1, 1, 1)}


@pytest.mark.parametrize("kind, mode", [("v2_lite", "EXTEND"), ("v2_lite", "DECODE"), ("v2_lite", "MIXED"),
                                        ("v3", "EXTEND"), ("v3", "DECODE"), ("v3", "MIXED")])
def test_each_family_gets_only_its_branches(kind, mode, pipeline):
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


def test_mixed_branches_split_at_the_symbolic_prefill_token_count(pipeline):
    run, layers = pipeline("v2_lite", "MIXED")
    graph, key = run.stages["MlaDispatchSplit"].after, PADDED_KEYS["MIXED"]
    n = step_size(graph, NUM_EXTEND_TOKENS).meta["val"]  # the graph input; the key's 8 is only its hint
    branches = [node for node in graph.nodes if str(node.target) in (PREFILL, DECODE)]
    assert len(branches) == 2 * layers
    for node in branches:
        tokens = node.args[0].meta["val"].shape[0]
        total = node.args[0].args[0].meta["val"].shape[0]  # q_nope before the slice: the step's T tokens
        assert isinstance(tokens, torch.SymInt) and isinstance(total, torch.SymInt)
        want = n if str(node.target) == PREFILL else total - n
        assert tokens.node.expr == want.node.expr
    assert (n.node.hint, total.node.hint) == (key.num_extend_tokens, key.num_tokens)


def test_mixed_graph_without_a_prefill_token_input_is_refused(history):
    engine, batches = history("v3")
    with pytest.raises(Exception, match="MIXED graph must take its token count and prefill-token count"):
        run_pipeline(engine, batches["DECODE"], PADDED_KEYS["DECODE"], [MlaDispatchSplit(ForwardMode.MIXED)])


def test_does_not_fire_without_attention():
    split = MlaDispatchSplit(ForwardMode.DECODE)
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph
    split(graph)
    assert split.matches == 0
