"""``encore::dense``: a dense projection x · wᵀ that a one-token step runs through a GEMV.

The small-M GEMV pass (passes/small_m_gemv.py) puts this op in place of a DECODE graph's weight
GEMMs where the GEMV takes their layout (``gemv_layout``). A step of
``GEMV_TOKENS`` token on CUDA then runs the Triton GEMV (gemv_triton.py: the weight read overlaps
the kernel before it); a larger step, and the CPU, run ``torch.mm`` as before (past one token
cuBLAS is the faster one).
"""

from __future__ import annotations

import torch

# Where the GEMV runs instead of cuBLAS: one token (bench_small_m.py, H100: 0.26-0.95x cuBLAS's time at
# every DeepSeek shape with one token; with two, 0.39-1.11x; with four, up to 1.58x).
GEMV_TOKENS = 1
GEMV_MAX_K = 16384  # the whole reduction in one register tile of at most this many elements


@torch.library.custom_op("encore::dense", mutates_args=())
def dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] · w [N, K]ᵀ -> [M, N]."""
    return torch.mm(x, w.t())


def gemv_layout(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the GEMV takes x [M, K] · w [N, K]ᵀ (shapes, strides and dtypes only; M is the caller's)."""
    return (x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and w.shape[1] <= GEMV_MAX_K
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.dtype == x.dtype
            and x.stride(1) == 1 and w.stride(1) == 1)


@dense.register_kernel("cuda")
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from encore.backends import gemv_triton  # triton is imported on first use

    if x.shape[0] <= GEMV_TOKENS and gemv_layout(x, w):
        return gemv_triton.gemv(x, w)
    return torch.mm(x, w.t())


@dense.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])
