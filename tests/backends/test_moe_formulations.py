"""experts_grouped against the reference (experts_torch), on the CPU (the Triton fused MoE: test_moe_triton)."""

from __future__ import annotations

import pytest
import torch

from encore.backends.moe import experts_grouped, experts_torch


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
    assert torch.equal(torch.ops.encore.routed_experts(*args), experts_torch(*args))
