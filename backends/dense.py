"""``encore::dense``: a dense projection x · wᵀ that a step of a few tokens runs through a GEMV; and
MLA's absorbed per-head projections, which attention backends run through the batched GEMV by a
like rule.

The small-M GEMV pass (passes/small_m_gemv.py) puts this op in place of a DECODE graph's weight
GEMMs that the GEMV runs faster (``use_gemv``). A step whose token count and weight pass
``runs_gemv`` then runs the Triton GEMV on CUDA (gemv_triton.py: the weight read overlaps the kernel
before it); other steps, and the CPU, run ``torch.mm`` as before. ``encore::rms_norm_dense`` and
``add_rms_norm_dense`` are a norm (after a residual add) and the dense it feeds, which
passes/fuse_norms.py makes one op so that the GEMV normalizes x itself.
"""

from __future__ import annotations

import torch

# Where the GEMV runs instead of cuBLAS (bench_small_m.py): one token and weights of at most 2^30
# elements, or 2-4 tokens and at most 2^23 elements of weight times tokens. At one token, with its loads
# 16-byte vectors (session 44), it took 0.25-0.90x cuBLAS's time on an H100 for every DeepSeek
# projection, router, dense MLP and LM head measured, up to V3's LM head (927M elements: 579 against
# 658 µs), and 0.22-0.91x on an H200 for those up to V2-Lite's LM head and V3's o_proj; the limit is
# the power of two above the largest. Each token past the first costs it a pass over its weight
# registers, so the weight it wins on shrinks with the tokens (session 31, µs against cuBLAS's):
# V2-Lite's o_proj (4.2M) 3.8 against 6.0 at two tokens, its q/kv_a (7.5M) 7.3 against 6.7 at two, the
# router 2.9 against 4.7 at four; session 44 at two tokens, H200: V3's q_b (38M) 23.7 against 21.6 and
# o_proj (117M) 78 against 60. The absorbed per-head products (2^20 elements on V2-Lite) win at two
# tokens (1.8 and 2.3 against 3.2 and 3.7) and not at four for W_UV (4.9 against 3.6):
# BATCHED_GEMV_TOKENS.
GEMV_TOKENS = 4
GEMV_MAX_WEIGHT = 1 << 30
GEMV_MAX_WEIGHT_TOKENS = 1 << 23
BATCHED_GEMV_TOKENS = 2
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
    """Whether x · wᵀ can run on the GEMV at one token: a layout it takes and a weight of at most
    GEMV_MAX_WEIGHT elements (``gemv_pays`` then rules by the tokens)."""
    return gemv_layout(x, w) and w.numel() <= GEMV_MAX_WEIGHT


def gemv_pays(tokens: int, weight_elements: int, max_tokens: int = GEMV_TOKENS) -> bool:
    """Whether the GEMV beats cuBLAS at this many tokens (1..``max_tokens``) and weight elements."""
    if tokens == 1:
        return weight_elements <= GEMV_MAX_WEIGHT
    return 1 < tokens <= max_tokens and tokens * weight_elements <= GEMV_MAX_WEIGHT_TOKENS


def runs_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether this x · wᵀ runs on the GEMV: a layout it takes and ``gemv_pays`` (which holds the weight
    to ``use_gemv``'s limit at one token, and to a smaller one past it)."""
    return gemv_layout(x, w) and gemv_pays(x.shape[0], w.numel())


@dense.register_kernel("cuda")
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from encore.backends import gemv_triton  # triton is imported on first use

    if runs_gemv(x, w):
        return gemv_triton.gemv(x, w)
    return torch.mm(x, w.t())


@dense.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek's RMSNorm (as transformers computes it): float32 statistics, the normalized row rounded to
    x's dtype, then times the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@torch.library.custom_op("encore::rms_norm_dense", mutates_args=())
def rms_norm_dense(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor) -> torch.Tensor:
    """dense(rms_norm(x, norm_weight, eps), w): a decode graph's norm and the projection it feeds
    (passes/fuse_norms.py), one GEMV launch on CUDA where ``runs_gemv``."""
    return torch.mm(rms_norm(x, norm_weight, eps), w.t())


@rms_norm_dense.register_kernel("cuda")
def _(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor) -> torch.Tensor:
    return _norm_dense_cuda(x, None, norm_weight, eps, w)[0]


@rms_norm_dense.register_fake
def _(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("encore::add_rms_norm_dense", mutates_args=())
def add_rms_norm_dense(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense(rms_norm(x + delta, norm_weight, eps), w), x + delta): a residual add, the norm after it and
    the projection it feeds, one GEMV launch on CUDA where ``runs_gemv``."""
    total = x + delta
    return torch.mm(rms_norm(total, norm_weight, eps), w.t()), total


@add_rms_norm_dense.register_kernel("cuda")
def _(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
      w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_dense_cuda(x, delta, norm_weight, eps, w)


def _norm_dense_cuda(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused norm ops' CUDA kernel: (dense(rms_norm(x (+ delta))), x + delta or None), one GEMV
    launch where ``runs_gemv``, else the Triton norm and ``torch.mm``."""
    from encore.backends import gemv_triton  # triton is imported on first use

    if runs_gemv(x, w):
        return gemv_triton.rms_norm_gemv(x, norm_weight, eps, w, delta)[:2]
    normed, total = gemv_triton.rms_norm(x, norm_weight, eps, delta)
    return torch.mm(normed, w.t()), total


@add_rms_norm_dense.register_fake
def _(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
      w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], w.shape[0]), torch.empty_like(x)


def runs_batched_gemv(tokens: int, w: torch.Tensor) -> bool:
    """``gemv_pays`` for per-head weights [H, ·, ·] (all heads' elements counted), up to
    BATCHED_GEMV_TOKENS tokens."""
    return gemv_pays(tokens, w.numel(), BATCHED_GEMV_TOKENS)


def absorb_query(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """MLA's latent queries: q_nope [T, H, dn] · W_kc [H, dn, R] per head -> [T, H, R] in q_nope's dtype,
    contiguous (flashinfer's MLA takes no other layout): the batched GEMV under its rule, else a batched
    GEMM writing each head's rows in place through a [H, T, R] view (as ``project_values`` does)."""
    w_kc = w_kc.to(q_nope.dtype)
    q_lat = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_kc.shape[2])
    if not runs_batched_gemv(q_nope.shape[0], w_kc):
        torch.bmm(q_nope.transpose(0, 1), w_kc, out=q_lat.transpose(0, 1))
        return q_lat
    from encore.backends.gemv_triton import batched_gemv  # triton is imported on first use

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
