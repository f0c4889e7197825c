"""The RoPE + cache write and the decode's latent query as one op in DECODE graphs: every layer's decode
takes the latent query the fused op computes, and the graph computes what the eager model does."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from encore.backends import mla_ops  # noqa: F401  (registers torch.ops.encore.*)
from encore.passes.fuse_rope_absorb import FuseRopeAbsorb
from graph_helpers import op_counts, rel_err

ROPE, ROPE_ABSORB, DECODE = ("encore.rope_cache_write.default", "encore.rope_absorb.default",
                             "encore.mla_decode.default")


@pytest.mark.parametrize("kind", ["v2_lite", "v3"])
def test_every_decode_takes_its_latent_query(kind, pipeline):
    run, layers = pipeline(kind, "DECODE")
    stage = run.stages["FuseRopeAbsorb"]
    before, after = stage.counts_before, stage.counts_after
    assert (before[ROPE], before[ROPE_ABSORB]) == (layers, 0)
    assert (after[ROPE], after[ROPE_ABSORB], after[DECODE]) == (0, layers, layers) and stage.matches == layers
    for decode in (n for n in stage.after.nodes if str(n.target) == DECODE):
        q_rot, q_lat = decode.args[1], decode.kwargs["q_lat"]
        fused = q_lat.args[0]
        assert str(fused.target) == ROPE_ABSORB and (q_rot.args, q_lat.args) == ((fused, 0), (fused, 1))
        assert fused.args[1] is decode.args[0] and fused.args[6] is decode.args[2]  # q_nope, w_kc
        assert len(fused.args) == 11  # the kv norm FuseNorms folded in stays
    assert rel_err(stage.hidden, run.eager) < 1e-5


@pytest.mark.parametrize("kind", ["v2_lite"])
@pytest.mark.parametrize("mode", ["MIXED", "EXTEND"])
def test_other_families_keep_the_rope(kind, mode, pipeline):
    run, layers = pipeline(kind, mode)
    final = list(run.stages.values())[-1].after
    assert "FuseRopeAbsorb" not in run.stages and op_counts(final)[ROPE] == layers


def _layer(positions, q_nope, q_pe, kv_c, k_pe, cos_sin, w_kc, w_vc, cache, other_cache, read_q, write_between):
    q_rot = torch.ops.encore.rope_cache_write(positions, q_pe, kv_c, k_pe, cos_sin, cache, True)
    if write_between:
        torch.ops.encore.write_latent_cache(kv_c, k_pe, cache)
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_vc.shape[1])
    torch.ops.encore.mla_decode(q_nope, q_rot, w_kc, w_vc, cache, out)
    return (out, q_rot * 2) if read_q else (out,)


@pytest.mark.parametrize(("read_q", "write_between", "fuses"), [(False, False, True), (True, False, False),
                                                                (False, True, False)],
                         ids=["fuses", "query-read-elsewhere", "cache-written-between"])
def test_fires_only_where_the_decode_alone_reads_the_rotated_query(read_q, write_between, fuses):
    args = (torch.arange(2), torch.randn(2, 3, 4), torch.randn(2, 3, 2), torch.randn(2, 6), torch.randn(2, 2),
            torch.randn(8, 2), torch.randn(3, 4, 6), torch.randn(3, 5, 6), torch.zeros(4, 4, 8),
            torch.zeros(4, 4, 8))
    graph = make_fx(lambda *a: _layer(*a, read_q, write_between), tracing_mode="fake")(*args).graph
    fusion = FuseRopeAbsorb()
    fusion(graph)
    graph.lint()
    counts = op_counts(graph)
    assert fusion.matches == (1 if fuses else 0)
    assert (counts[ROPE], counts[ROPE_ABSORB]) == ((0, 1) if fuses else (1, 0))
    decode = next(n for n in graph.nodes if str(n.target) == DECODE)
    assert ("q_lat" in decode.kwargs) == fuses
    if fuses:
        assert decode.kwargs["q_lat"].target is operator.getitem
