"""What encore's Triton kernels share: a kernel's tile and launch settings (``KernelConfig``), the input
checks that raise ``ValueError`` naming the bad value, and the dot precision of a dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Tile sizes and launch options of one kernel (block_m: queries per program, block_n: keys per
    iteration); powers of two of at least 16, as ``tl.dot`` needs."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value}: must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps}: must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages}: must be >= 1")


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        check(t.stride(-1) == 1, f"{name} has stride {tuple(t.stride())}; its last dim must be contiguous")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, f"tensors on different devices: {devices}")


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
