"""Whether a device launches kernels as programmatic dependents (PDL): CUDA on sm90 (Hopper) and newer.
A PDL kernel may start while the kernel before it finishes, and waits (``gdc_wait``) before it reads
what that kernel wrote: encore's GEMV (gemv_triton.py) and Inductor's kernels (graphs/compiler.py)."""

from __future__ import annotations

import functools

import torch


def pdl_supported(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _sm90_or_newer(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm90_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9
