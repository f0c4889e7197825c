"""Host tensors from Python lists, for the per-step copies to the device.

``torch.tensor(list)`` converts element by element through PyTorch's generic sequence path: ~60 µs
for 600 ints on this repo's CPU. Packing the list into an ``array`` first and wrapping its buffer
takes ~20 µs, and a step builds several such tensors (the batch layout, the sampling parameters).
"""

from __future__ import annotations

import array

import torch

_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of ``values`` (ints or floats) in ``dtype`` (int64, int32 or float32)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)
