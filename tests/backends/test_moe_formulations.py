"""experts_grouped against the reference (experts_torch), and the shared experts fused into the routed
ones against the shared MLP, on the CPU (the Triton fused MoE: test_moe_triton)."""

from __future__ import annotations

import pytest
import torch

from encore.backends.moe import experts_grouped, experts_torch, with_shared_experts
from encore.models.deepseek import DenseMLP


def routed(tokens: int, experts: int = 8, k: int = 3, hidden: int = 32, inter: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])  # distinct per token
    weights = torch.rand(tokens, k, generator=gen)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_matches_reference(tokens):
    args = routed(tokens)
    assert torch.allclose(experts_grouped(*args), experts_torch(*args), rtol=1e-5, atol=1e-5)


def test_grouped_handles_experts_no_token_chose():
    x, w13, w2, weights, ids = routed(4, experts=16, k=2)
    ids = ids % 3  # only experts 0-2 get tokens...
    ids[:, 1] = (ids[:, 0] + 1) % 3  # ...each token two distinct ones
    assert torch.allclose(experts_grouped(x, w13, w2, weights, ids), experts_torch(x, w13, w2, weights, ids),
                          rtol=1e-5, atol=1e-5)


def test_routed_experts_op_is_the_reference_on_cpu():
    args = routed(5)
    assert torch.equal(torch.ops.encore.routed_experts(*args, 0), experts_torch(*args))


@pytest.mark.parametrize("num_shared", [1, 2])
def test_fused_shared_experts_are_the_shared_mlp(num_shared):
    """Routed experts plus the shared MLP == the fused stacks with the shared experts taken by every
    token at weight 1, through the reference and the grouped formulation alike."""
    x, w13, w2, weights, ids = routed(6)
    experts, inter = w13.shape[0], w2.shape[2]
    shared = DenseMLP(32, num_shared * inter)
    torch.nn.init.normal_(shared.gate_up_proj.weight, std=0.2)
    torch.nn.init.normal_(shared.down_proj.weight, std=0.2)
    with torch.no_grad():
        want = experts_torch(x, w13, w2, weights, ids) + shared(x)
    fused_w13, fused_w2 = with_shared_experts(w13, w2, shared.gate_up_proj.weight.detach(),
                                              shared.down_proj.weight.detach(), num_shared)
    assert fused_w13.shape == (experts + num_shared, *w13.shape[1:]) and torch.equal(fused_w13[:experts], w13)
    assert fused_w2.shape == (experts + num_shared, *w2.shape[1:]) and torch.equal(fused_w2[:experts], w2)
    shared_ids = torch.arange(experts, experts + num_shared).expand(6, -1)
    all_ids, all_weights = torch.cat([ids, shared_ids], 1), torch.cat([weights, torch.ones(6, num_shared)], 1)
    for formulation in (experts_torch, experts_grouped):
        torch.testing.assert_close(formulation(x, fused_w13, fused_w2, all_weights, all_ids), want,
                                   rtol=1e-5, atol=1e-5)


def test_fused_shared_experts_reject_a_wrong_width():
    x, w13, w2, weights, ids = routed(2)
    with pytest.raises(ValueError, match=r"gate_up \(48, 32\), down \(32, 24\): expected \[64, 32\] and \[32, 32\]"):
        with_shared_experts(w13, w2, torch.zeros(48, 32), torch.zeros(32, 24), 2)
