"""Shared experts fused into the routed experts (what the engine does on CUDA) keep the model's outputs."""

from __future__ import annotations

import pytest
import torch

from checkpoints import write_mtp_checkpoint
from encore.engine import Engine, SamplingParams
from encore.models.deepseek import MoE, fuse_shared_experts

PROMPTS = [[5, 9, 2, 7, 3, 14], [11, 4, 8]]


@pytest.mark.parametrize("kind, num_shared", [("v2_lite", 2), ("v3 + mtp", 1)])
def test_fusion_keeps_tokens_and_logprobs(kind, num_shared, checkpoint, tmp_path):
    if kind == "v3 + mtp":  # the MTP layer's MoE is fused too, and its drafts stay the same
        engine = Engine(str(write_mtp_checkpoint(tmp_path)), device="cpu", dtype="float32",
                        speculative={"method": "mtp", "num_speculative_tokens": 2})
    else:
        engine = Engine(str(checkpoint(kind)), device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    before = engine.generate(PROMPTS, params)
    model = engine.runner.model
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    experts = moe[0].experts.w13.shape[0]
    assert fuse_shared_experts(model) == len(moe) > 0
    assert all(m.shared_experts is None and m.num_fused_shared == num_shared for m in moe)
    assert all(m.experts.w13.shape[0] == m.experts.w2.shape[0] == experts + num_shared for m in moe)
    assert fuse_shared_experts(model) == 0
    after = engine.generate(PROMPTS, params)
    for was, now in zip(before, after):
        assert now.token_ids == was.token_ids
        assert now.num_accepted_tokens == was.num_accepted_tokens
        for a, b in zip(was.logprobs, now.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_fuses_and_matches_the_cpu_reference(checkpoint):
    """On CUDA the engine fuses every MoE layer's shared experts (graphs and all); float32 greedy
    tokens equal the CPU's unfused reference, logprobs within float32 GEMM rounding."""
    cpu = Engine(str(checkpoint("v2_lite")), device="cpu", dtype="float32")
    gpu = Engine(str(checkpoint("v2_lite")), device="cuda", dtype="float32")
    moe = [m for m in gpu.runner.model.modules() if isinstance(m, MoE)]
    assert moe and all(m.shared_experts is None and m.num_fused_shared == 2 for m in moe)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    for want, got in zip(cpu.generate(PROMPTS, params), gpu.generate(PROMPTS, params)):
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-3)
