"""Auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2) for transformers' `DeepseekV3TopkRouter`.

The router picks experts by `sigmoid(logits) + e_score_correction_bias` but weights them by the unbiased
scores, so the bias steers load without entering the gradient. After each step every router's bias moves
by a fixed `rate` toward balance: `bias_e += rate * sign(mean_load - load_e)`. transformers keeps the bias
as a buffer and never updates it, so the counts are taken from the routers' outputs with forward hooks.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter


class ExpertBiasBalancer:
    """Counts the tokens each expert of each router receives and applies the sign update to the biases."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        if rate < 0:
            raise ValueError(f"bias update rate={rate} must be >= 0")
        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        if not self.routers:
            raise ValueError("model has no DeepseekV3TopkRouter to balance")
        self.loads = [torch.zeros_like(r.e_score_correction_bias) for r in self.routers]
        self._hooks = [r.register_forward_hook(self._counter(load)) for r, load in zip(self.routers, self.loads)]

    @staticmethod
    def _counter(load: torch.Tensor) -> Callable[[nn.Module, tuple, tuple[torch.Tensor, ...]], None]:
        def hook(_module: nn.Module, _inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
            topk_indices = output[2]  # [tokens, top_k]
            load.add_(torch.bincount(topk_indices.flatten(), minlength=load.numel()).to(load.dtype))

        return hook

    def close(self) -> None:
        """Stop counting (evaluation and generation after training would otherwise keep adding)."""
        for hook in self._hooks:
            hook.remove()

    def reset(self) -> None:
        for load in self.loads:
            load.zero_()

    def max_violation(self) -> float:
        """DeepSeek's MaxVio, max_e(load_e) / mean(load) - 1, averaged over routers (0 is perfect balance)."""
        ratios = [(load.max() / load.mean().clamp_min(1e-9)).item() - 1 for load in self.loads]
        return sum(ratios) / len(ratios)

    @torch.no_grad()
    def update(self) -> None:
        """Apply the bias step for the loads counted since `reset()`."""
        for router, load in zip(self.routers, self.loads):
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
