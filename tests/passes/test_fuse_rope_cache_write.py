"""Pre-attention RoPE + latent-cache write fusion."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from encore.backends.context import StepContext
from encore.graphs.compiler import CompiledModel
from encore.graphs.keys import GraphKey
from encore.passes.fuse_rope_cache_write import FuseRopeCacheWrite
from graph_helpers import Snapshot, op_counts, rel_err

ROTARY, WRITE, FUSED = "encore.rotary.default", "encore.write_latent_cache.default", "encore.rope_cache_write.default"


@pytest.mark.parametrize("kind, mode", [("v2_lite", "EXTEND"), ("v3", "MIXED")])
def test_rotary_and_cache_write_become_one_op(kind, mode, pipeline):
    run, layers = pipeline(kind, mode)
    stage = run.stages["FuseRopeCacheWrite"]
    assert stage.matches == layers
    before, after = stage.counts_before, stage.counts_after
    assert (before[ROTARY], before[WRITE], before[FUSED]) == (layers, layers, 0)
    assert (after[ROTARY], after[WRITE], after[FUSED]) == (0, 0, layers)
    assert rel_err(stage.hidden, run.eager) < 1e-5


class KeyAlsoReturned(nn.Module):
    """The rotated key has a second user (it is returned): fusing would lose it."""

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__()
        self.cache = cache
        self.cos_sin = torch.randn(16, 8)

    def forward(self, input_ids, positions, batch):
        q_pe = torch.randn(input_ids.shape[0], 2, 8)
        kv_c, k_pe = torch.randn(input_ids.shape[0], 40).split([32, 8], dim=-1)
        q_rot, k_rot = torch.ops.encore.rotary(positions, q_pe, k_pe, self.cos_sin, True)
        torch.ops.encore.write_latent_cache(kv_c, k_rot, self.cache)
        return q_rot.sum() + k_rot.sum()


def test_does_not_fire_when_rotated_key_has_another_user(history):
    engine, batches = history("v3")
    batch = batches["DECODE"]
    fusion, after = FuseRopeCacheWrite(), Snapshot()
    compiled = CompiledModel(KeyAlsoReturned(torch.zeros(64, 4, 40)), lambda k: [fusion, after], inductor=False)
    with torch.inference_mode(), StepContext(engine.runner.backend).bind(batch):
        compiled(GraphKey(0, 1, batch.bs, batch.num_tokens), batch)
    assert fusion.matches == 0
    counts = op_counts(after.graphs[0])
    assert (counts[ROTARY], counts[WRITE], counts[FUSED]) == (1, 1, 0)
