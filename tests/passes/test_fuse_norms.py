"""Norms into their consumers: a DECODE graph's RMSNorms go into the GEMV, the router or the RoPE + cache
write that reads them; the graph computes what the eager model does."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from encore.backends.dense import rms_norm
from encore.passes.fuse_norms import FuseNorms, match_rms_norm
from graph_helpers import op_counts, rel_err

DENSE, NORM_DENSE, ADD_NORM_DENSE = ("encore.dense.default", "encore.rms_norm_dense.default",
                                     "encore.add_rms_norm_dense.default")
ROUTE, ADD_NORM_ROUTE, ROPE = "encore.route.default", "encore.add_rms_norm_route.default", \
    "encore.rope_cache_write.default"
RSQRT = "aten.rsqrt.default"


@pytest.mark.parametrize("kind", ["v2_lite", "v3"])
def test_every_norm_but_the_last_goes_into_its_consumer(kind, pipeline, checkpoint):
    """Per layer: the input norm into the q/kv_a GEMV (the first layer's without an add), the kv norm into
    the RoPE + cache write, the post-attention norm into the router (MoE layers) or the gate_up GEMV
    (dense layers); V3's q_a norm into q_b's GEMV. Only the final norm stays."""
    run, layers = pipeline(kind, "DECODE")
    stage = run.stages["FuseNorms"]
    before, after = stage.counts_before, stage.counts_after
    moe = sum(1 for n in stage.before.nodes if str(n.target) == ROUTE)
    q_lora = 1 if kind == "v3" else 0
    assert 0 < moe < layers
    assert before[RSQRT] == 3 * layers + q_lora * layers + 1 and after[RSQRT] == 1
    assert after[NORM_DENSE] == 1 + q_lora * layers  # the first layer's input norm, V3's q_a norms
    assert after[ADD_NORM_DENSE] == (layers - 1) + (layers - moe)
    assert (after[ADD_NORM_ROUTE], after[ROUTE]) == (moe, 0)
    assert after[DENSE] == before[DENSE] - after[NORM_DENSE] - after[ADD_NORM_DENSE]
    fused_ropes = [n for n in stage.after.nodes if str(n.target) == ROPE and len(n.args) == 9]
    assert len(fused_ropes) == layers
    assert stage.matches == after[NORM_DENSE] + after[ADD_NORM_DENSE] + moe + layers
    assert rel_err(stage.hidden, run.eager) < 1e-5


def _step(x, d, nw, w, w2):
    h = x + d
    n = rms_norm(h, nw, 1e-6)
    return torch.ops.encore.dense(n, w), torch.ops.encore.dense(n, w2), h


def test_a_norm_read_twice_stays():
    """A normed row with two GEMVs (or any other user) is left as it is."""
    args = (torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.randn(4, 8), torch.randn(3, 8))
    graph = make_fx(_step, tracing_mode="fake")(*args).graph
    before = op_counts(graph)
    fusion = FuseNorms()
    fusion(graph)
    assert fusion.matches == 0 and op_counts(graph) == before


def test_an_add_read_before_the_gemv_stays_outside():
    """The sum's other user comes before the GEMV: the norm fuses without the add."""

    def step(x, d, nw, w):
        h = x + d
        early = h * 2
        return early, torch.ops.encore.dense(rms_norm(h, nw, 1e-6), w), h

    args = (torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.randn(4, 8))
    module = make_fx(step, tracing_mode="fake")(*args)
    fusion = FuseNorms()
    fusion(module.graph)
    module.recompile()
    counts = op_counts(module.graph)
    assert fusion.matches == 1 and counts[NORM_DENSE] == 1 and counts["aten.add.Tensor"] == 1
    got, want = module(*args), step(*args)
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_matcher_takes_only_the_norm_as_traced(weight_dtype):
    """``match_rms_norm`` finds the bf16 form (casts to float32 and back) and refuses a norm whose weight
    has another dtype than x (the fused kernels multiply in x's dtype)."""
    x, nw = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8, dtype=weight_dtype)
    graph = make_fx(lambda x, nw: rms_norm(x, nw, 1e-5), tracing_mode="fake")(x, nw).graph
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    found = match_rms_norm(out)
    if weight_dtype == torch.bfloat16:
        assert found is not None and found.eps == 1e-5 and found.x.op == "placeholder" and len(found.nodes) == 8
    else:
        assert found is None
    scaled = make_fx(lambda x, nw: nw * (x * 2.0), tracing_mode="fake")(x, nw.bfloat16()).graph
    assert match_rms_norm(next(n for n in scaled.nodes if n.op == "output").args[0]) is None
