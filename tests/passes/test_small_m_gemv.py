"""Small-M GEMV: a DECODE graph's weight GEMMs become ``encore::dense``; nothing else changes."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from encore.backends.dense import GEMV_MAX_WEIGHT
from encore.passes.small_m_gemv import SmallMGemv
from graph_helpers import op_counts, rel_err

MM, T, DENSE, AS_STRIDED = "aten.mm.default", "aten.t.default", "encore.dense.default", "aten.as_strided.default"


@pytest.mark.parametrize("kind", ["v2_lite", "v3"])
def test_decode_weight_gemms_become_dense(kind, pipeline):
    run, layers = pipeline(kind, "DECODE")
    stage = run.stages["SmallMGemv"]
    before, after = stage.counts_before, stage.counts_after
    assert stage.matches == before[MM] > 2 * layers  # per layer at least q/kv_a and o_proj
    assert (after[MM], after[T], after[DENSE]) == (0, before[T] - before[MM], before[MM])
    fused = [n for n in stage.after.nodes if str(n.target) == DENSE and str(n.args[1].target) == AS_STRIDED]
    assert len(fused) == layers  # the q/kv_a GEMM over FuseQkvAProj's view of the adjacent weights
    assert all(n.args[1].op == "placeholder" for n in stage.after.nodes
               if str(n.target) == DENSE and n not in fused)
    assert rel_err(stage.hidden, run.eager) < 1e-5


@pytest.mark.parametrize("mode", ["EXTEND", "MIXED"])
def test_not_in_prompt_families(mode, pipeline):
    run, _ = pipeline("v2_lite", mode)
    assert "SmallMGemv" not in run.stages


def test_leaves_other_matmuls():
    """An activation times an activation, a weight the GEMV cannot read row by row (a graph input
    stored transposed: its K is not contiguous) and a weight past GEMV_MAX_WEIGHT elements (cuBLAS
    is faster there) stay ``mm``."""

    def step(x, w, big):
        a = x * 2
        y = torch.mm(a, torch.t(a))
        return torch.mm(y, torch.t(w)), torch.mm(x, torch.t(big))

    w = torch.randn(4, 6).t()  # [N 6, K 4], stride (1, 6)
    big = torch.empty(1, 8).expand(GEMV_MAX_WEIGHT // 8 + 1, 8)  # rows of stride 0: no memory behind them
    graph = make_fx(step, tracing_mode="fake")(torch.randn(4, 8), w, big).graph
    assert [n.meta["val"].stride() for n in graph.find_nodes(op="placeholder")][1] == (1, 6)
    before = op_counts(graph)
    gemv = SmallMGemv()
    gemv(graph)
    assert gemv.matches == 0 and op_counts(graph) == before and before[MM] == 3

    small = torch.empty(1, 8).expand(GEMV_MAX_WEIGHT // 8, 8)  # at the limit: rewritten
    graph = make_fx(step, tracing_mode="fake")(torch.randn(4, 8), w, small).graph
    gemv(graph)
    assert gemv.matches == 1 and op_counts(graph)[DENSE] == 1
