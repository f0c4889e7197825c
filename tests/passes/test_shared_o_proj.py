"""Shared o_proj: the two branches write one buffer in place, no concatenation."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from encore.passes.shared_o_proj import SharedOProj
from graph_helpers import op_counts, rel_err

CAT, EMPTY, SLICE, MM = "aten.cat.default", "aten.empty.memory_format", "aten.slice.Tensor", "aten.mm.default"
BRANCHES = ("encore.mla_prefill.default", "encore.mla_decode.default")


@pytest.mark.parametrize("kind", ["v2_lite", "v3"])
def test_mixed_branches_share_one_output_and_one_o_proj(kind, pipeline):
    run, layers = pipeline(kind, "MIXED")
    split, stage = run.stages["MlaDispatchSplit"], run.stages["SharedOProj"]
    assert stage.matches == layers
    before, after = stage.counts_before, stage.counts_after
    assert (before[CAT], after[CAT]) == (layers, 0)
    assert after[EMPTY] == split.counts_before[EMPTY]  # one output buffer per layer, as before the split
    assert after[MM] == before[MM]  # o_proj: still one GEMM per layer
    outs = [n.args[5] for n in stage.after.nodes if str(n.target) in BRANCHES]
    assert len(outs) == 2 * layers  # each branch writes a slice of the layer's one buffer
    assert all(str(o.target) == SLICE and str(o.args[0].target) == EMPTY for o in outs)
    assert len({o.args[0] for o in outs}) == layers
    assert rel_err(stage.hidden, run.eager) < 1e-5


@pytest.mark.parametrize("mode", ["DECODE", "EXTEND"])
def test_nothing_to_share_with_one_branch(mode, pipeline):
    run, _ = pipeline("v3", mode)
    stage = run.stages["SharedOProj"]
    assert stage.matches == 0 and stage.counts_after == stage.counts_before


def test_does_not_fire_on_other_concatenations():
    def two_parts(x):
        a = torch.empty(2, 3)
        a.copy_(x[:2])
        return torch.cat([a, x[2:]])

    graph = make_fx(two_parts)(torch.randn(5, 3)).graph
    before = op_counts(graph)
    shared = SharedOProj()
    shared(graph)
    assert shared.matches == 0 and op_counts(graph) == before
