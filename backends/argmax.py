"""The argmax of each logits row: the greedy pick. On CUDA two Triton launches (argmax_triton.py),
elsewhere ``torch.argmax``."""

from __future__ import annotations

import torch


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> the index of each row's maximum [N] (int64), equal to ``logits.argmax(dim=-1)``
    (ties to the lowest index, a NaN the maximum). On CUDA the rows' columns must be contiguous."""
    if logits.is_cuda:
        from encore.backends.argmax_triton import argmax_triton  # triton is imported on first use
        return argmax_triton(logits)
    return logits.argmax(dim=-1)
