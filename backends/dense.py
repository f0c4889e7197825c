"""``encore::dense``: a dense projection x · wᵀ that a one-token step runs through a GEMV; and MLA's
absorbed per-head projections, which attention backends run through the batched GEMV by the same rule.

The small-M GEMV pass (passes/small_m_gemv.py) puts this op in place of a DECODE graph's weight
GEMMs that the GEMV runs faster (``use_gemv``). A step of ``GEMV_TOKENS`` token on CUDA then runs
the Triton GEMV (gemv_triton.py: the weight read overlaps the kernel before it); a larger step, and
the CPU, run ``torch.mm`` as before (past one token cuBLAS is the faster one).
"""

from __future__ import annotations

import torch

# Where the GEMV runs instead of cuBLAS (bench_small_m.py): one token, weights of at most 2^24 elements.
# At one token it took 0.27-0.97x cuBLAS's time for DeepSeek's projections and routers up to V3's
# q_a/kv_a (15M elements) on an H200, 0.26-0.95x on an H100; past that the devices disagree (H200:
# 1.01x V3's q_b, 1.06x V2-Lite's LM head, 1.20x V3's o_proj). From two tokens cuBLAS wins the large
# shapes (up to 2.5x at four).
GEMV_TOKENS = 1
GEMV_MAX_WEIGHT = 1 << 24
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


def use_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a one-token x · wᵀ runs on the GEMV: a layout it takes and a weight of at most
    GEMV_MAX_WEIGHT elements."""
    return gemv_layout(x, w) and w.numel() <= GEMV_MAX_WEIGHT


def runs_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether this x · wᵀ runs on the GEMV: ``use_gemv``, at GEMV_TOKENS tokens or fewer."""
    return x.shape[0] <= GEMV_TOKENS and use_gemv(x, w)


@dense.register_kernel("cuda")
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from encore.backends import gemv_triton  # triton is imported on first use

    if runs_gemv(x, w):
        return gemv_triton.gemv(x, w)
    return torch.mm(x, w.t())


@dense.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def runs_batched_gemv(tokens: int, w: torch.Tensor) -> bool:
    """``runs_gemv``'s rule for per-head weights [H, ·, ·] (all heads' elements counted)."""
    return tokens <= GEMV_TOKENS and w.numel() <= GEMV_MAX_WEIGHT


def absorb_query(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """MLA's latent queries: q_nope [T, H, dn] · W_kc [H, dn, R] per head -> [T, H, R] in q_nope's dtype.
    Under the GEMV rule, the batched GEMV into a contiguous result; else a batched GEMM written
    head-major (a [T, H, R] view of [H, T, R]: no transposing copy on either side)."""
    w_kc = w_kc.to(q_nope.dtype)
    if not runs_batched_gemv(q_nope.shape[0], w_kc):
        return torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)
    from encore.backends.gemv_triton import batched_gemv  # triton is imported on first use

    q_lat = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_kc.shape[2])
    return batched_gemv(q_nope, w_kc.transpose(1, 2), q_lat)


def project_values(o_lat: torch.Tensor, w_vc: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, H, dv] = o_lat [T, H, R] · W_vc [H, dv, R]ᵀ per head (MLA's latent attention output to
    values), in place: the batched GEMV under its rule, else a batched GEMM."""
    w_vc = w_vc.to(o_lat.dtype)
    if not runs_batched_gemv(o_lat.shape[0], w_vc):
        torch.bmm(o_lat.transpose(0, 1), w_vc.transpose(1, 2), out=out.transpose(0, 1))
        return
    from encore.backends.gemv_triton import batched_gemv

    batched_gemv(o_lat, w_vc, out)
