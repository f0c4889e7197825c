"""Pre-attention GEMM fusion: q (or q_a) and kv_a projections become one GEMM."""

from __future__ import annotations

import pytest
import torch

from encore.engine import Engine
from encore.graphs.weights import colocate_pre_attention_weights
from encore.passes.fuse_qkv_a_proj import FuseQkvAProj
from encore.passes.fx_utils import adjacent_rows
from graph_helpers import PADDED_KEYS, rel_err, run_pipeline

MM, AS_STRIDED = "aten.mm.default", "aten.as_strided.default"


@pytest.mark.parametrize("kind, mode", [("v2_lite", "MIXED"), ("v3", "DECODE")])  # q_proj, q_a_proj
def test_one_gemm_per_layer_over_colocated_weights(kind, mode, pipeline):
    run, layers = pipeline(kind, mode)
    stage = run.stages["FuseQkvAProj"]
    assert stage.matches == layers
    before, after = stage.counts_before, stage.counts_after
    head_views = 1 if kind == "v2_lite" else 0  # q_proj's output is viewed into heads; q_a_proj's is normed first
    assert before[AS_STRIDED] == 0 and after[AS_STRIDED] == layers * (1 + head_views)
    assert after[MM] == before[MM] - layers
    assert rel_err(stage.hidden, run.eager) < 1e-5


def test_query_head_view_adds_no_size_guard(checkpoint, tmp_path):
    # A view of the fused GEMM's query columns would guard T != 1: the bs=1 key would compile a second graph.
    engine = Engine(str(checkpoint("v2_lite")), device="cpu", compile=True, graph_cache_dir=str(tmp_path),
                    graph_decode_sizes=(1, 4), graph_mixed_extends=(), graph_extend_sizes=())
    compiled = engine.runner.graphs.compiled
    assert {k.bs for k in engine.runner.graphs.keys} == {1, 4}
    assert compiled.compiled_graphs == 1 and compiled.recompiles == 0


def test_colocation_keeps_weights_and_runs_once(checkpoint):
    model = Engine(str(checkpoint("v2_lite")), device="cpu").runner.model
    attn = model.model.layers[0].self_attn
    q_before, kv_before = attn.q_proj.weight.clone(), attn.kv_a_proj_with_mqa.weight.clone()
    assert colocate_pre_attention_weights(model) == 3
    assert torch.equal(attn.q_proj.weight, q_before) and torch.equal(attn.kv_a_proj_with_mqa.weight, kv_before)
    assert adjacent_rows(attn.q_proj.weight, attn.kv_a_proj_with_mqa.weight)
    assert colocate_pre_attention_weights(model) == 0


def test_does_not_fire_on_weights_in_separate_storage(history):
    # Fusing these would need a per-step concatenation of both weights: the pass must leave them.
    engine, batches = history("v3")
    run = run_pipeline(engine, batches["MIXED"], PADDED_KEYS["MIXED"], [FuseQkvAProj()])
    stage = run.stages["FuseQkvAProj"]
    assert stage.matches == 0
    assert stage.counts_after == stage.counts_before
