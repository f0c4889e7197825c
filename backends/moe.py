"""Mixture-of-experts routing, the routed-expert op and its torch formulations (the Triton fused MoE
is in ``moe_triton``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encore.backends.dense import rms_norm, runs_gemv


def select_experts(router_logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring_func: str,
                   topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing (the ModelConfig fields of the same names). router_logits [T, E] float32 ->
    (weights [T, k] float32, ids [T, k] int64).

    V2: softmax scores, optionally group-limited (max score per group); weights are normalized
    when ``norm_topk_prob`` else scaled by ``routed_scaling_factor``.
    V3 (noaux_tc): sigmoid scores; the choice uses scores + ``e_score_correction_bias`` and groups
    ranked by the sum of their two best; weights are the unbiased scores, optionally normalized, then
    scaled by ``routed_scaling_factor``.
    """
    k = top_k
    if scoring_func == "softmax":
        scores = router_logits.softmax(dim=-1)
    else:
        scores = router_logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if topk_method in ("group_limited_greedy", "noaux_tc") and n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)  # [T, G, E / G]
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_ids = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0).bool()
        fill = float("-inf") if topk_method == "noaux_tc" else 0.0
        choice = grouped.masked_fill(~group_mask[..., None], fill).flatten(1)
    ids = choice.topk(k, dim=-1, sorted=False).indices  # [T, k]
    weights = scores.gather(1, ids)
    if scoring_func == "sigmoid":
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * routed_scaling_factor, ids
    if k > 1 and norm_topk_prob:
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
    return weights * routed_scaling_factor, ids


@torch.library.custom_op("encore::route", mutates_args=())
def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring_func: str,
          topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
          num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: logits = x · weightᵀ in float32 (as transformers computes them), then
    ``select_experts``. x [T, H], weight [E, H] -> (weights [T, k + S] float32, ids [T, k + S] int64),
    the last S = ``num_shared`` columns for shared experts fused into the routed ones
    (``with_shared_experts``): experts E..E + S - 1, each with weight 1. CPU: the reference; CUDA: a
    16-bit GEMM with float32 output (products of 16-bit values are exact in float32: only the
    summation order differs from a float32 GEMM, and no cast of x or the weight is made; under
    ``dense.runs_gemv`` the GEMV of ``gemv_triton``) and the selection in one Triton kernel
    (``routing_triton``)."""
    weights, ids = select_experts(F.linear(x.float(), weight.float()), bias, top_k, scoring_func, topk_method,
                                  n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    if not num_shared:
        return weights, ids
    shared = torch.arange(weight.shape[0], weight.shape[0] + num_shared, device=x.device).expand(x.shape[0], -1)
    return torch.cat([weights, torch.ones(shared.shape, device=x.device)], 1), torch.cat([ids, shared], 1)


@route.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring_func: str,
      topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
      num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    from encore.backends import gemv_triton  # triton is imported on first use
    from encore.backends.routing_triton import select_experts_triton

    logits = gemv_triton.gemv(x, weight, torch.float32) if runs_gemv(x, weight) else _router_logits(x, weight)
    return select_experts_triton(logits, bias, top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob,
                                 routed_scaling_factor, num_shared)


def _router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x · weightᵀ in float32 off the GEMV: a 16-bit GEMM with float32 output where it can."""
    if x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


@route.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring_func: str,
      topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
      num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape[0], top_k + num_shared
    return x.new_empty(rows, cols, dtype=torch.float32), x.new_empty(rows, cols, dtype=torch.int64)


@torch.library.custom_op("encore::add_rms_norm_route", mutates_args=())
def add_rms_norm_route(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring_func: str,
                       topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool,
                       routed_scaling_factor: float, num_shared: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's residual add, post-attention norm and router: (``route(n, ...)``'s weights and ids, n,
    x + delta) for n = ``rms_norm(x + delta, norm_weight, eps)`` (passes/fuse_norms.py). CUDA: at the
    token counts where the router runs on the GEMV, the add and norm run inside it (program 0 stores
    n and the sum), so no norm kernel stands between the o_proj GEMV and the router's."""
    total = x + delta
    normed = rms_norm(total, norm_weight, eps)
    weights, ids = route(normed, weight, bias, top_k, scoring_func, topk_method, n_group, topk_group,
                         norm_topk_prob, routed_scaling_factor, num_shared)
    return weights, ids, normed, total


@add_rms_norm_route.register_kernel("cuda")
def _(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
      bias: torch.Tensor | None, top_k: int, scoring_func: str, topk_method: str, n_group: int, topk_group: int,
      norm_topk_prob: bool, routed_scaling_factor: float, num_shared: int
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from encore.backends import gemv_triton  # triton is imported on first use
    from encore.backends.routing_triton import select_experts_triton

    if runs_gemv(x, weight):
        logits, total, normed = gemv_triton.rms_norm_gemv(x, norm_weight, eps, weight, delta, torch.float32,
                                                          keep_normed=True)
    else:
        normed, total = gemv_triton.rms_norm(x, norm_weight, eps, delta)
        logits = _router_logits(normed, weight)
    weights, ids = select_experts_triton(logits, bias, top_k, scoring_func, topk_method, n_group, topk_group,
                                         norm_topk_prob, routed_scaling_factor, num_shared)
    return weights, ids, normed, total


@add_rms_norm_route.register_fake
def _(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
      bias: torch.Tensor | None, top_k: int, scoring_func: str, topk_method: str, n_group: int, topk_group: int,
      norm_topk_prob: bool, routed_scaling_factor: float, num_shared: int
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = x.shape[0], top_k + num_shared
    return (x.new_empty(rows, cols, dtype=torch.float32), x.new_empty(rows, cols, dtype=torch.int64),
            torch.empty_like(x), torch.empty_like(x))


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """Reference routed-expert SwiGLU. x [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H].

    Loops over the experts that received tokens; simple and exact, not capturable on CUDA.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = ids.flatten()  # [T * k]
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // ids.shape[1]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        tokens = token_of[start:start + n]
        start += n
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[expert])  # [n, H]
        out.index_add_(0, tokens, h.float() * weights.flatten()[pairs, None])
    return out.to(x.dtype)


def experts_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """Routed-expert SwiGLU with static shapes and no host reads (CUDA-graph capturable).

    The T·k (token, expert) pairs are sorted by expert (stable), counted with ``scatter_add_``
    (``bincount`` reads the host), run through two ``torch._grouped_mm`` over the expert groups,
    put back in pair order and summed per token with the routing weights — a fixed-order sum, so the
    result does not depend on atomics. x [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H].
    """
    tokens, k = ids.shape
    flat_ids = ids.flatten()  # [T * k]
    order = flat_ids.argsort(stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)  # [E] group ends
    gate, up = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)  # [T * k, I]
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)  # [T * k, H], expert order
    per_pair = torch.empty_like(y).index_copy_(0, order, y).view(tokens, k, -1)  # [T, k, H], pair order
    return (per_pair.float() * weights[..., None]).sum(dim=1).to(x.dtype)


def with_shared_experts(w13: torch.Tensor, w2: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' stacks with the shared experts appended as ``num_shared`` more experts of
    the same width: w13 [E, 2I, H], w2 [E, H, I], the shared MLP's gate_up [2·S·I, H] (all gate rows,
    then all up rows) and down [H, S·I] -> [E + S, 2I, H], [E + S, H, I].

    A SwiGLU MLP of width S·I is the sum of S MLPs over its I-wide slices (SiLU(gate)·up is per
    channel and down is linear over channels), so every token routed to experts E..E + S - 1 with
    weight 1 (``route(..., num_shared=S)``) gets exactly the shared MLP's output, from the same
    launches as the routed experts: DeepSeek's shared experts cost no GEMMs of their own."""
    _, two_i, hidden = w13.shape
    width = two_i // 2
    if gate_up.shape != (2 * num_shared * width, hidden) or down.shape != (hidden, num_shared * width):
        raise ValueError(f"shared experts gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}: expected "
                         f"[{2 * num_shared * width}, {hidden}] and [{hidden}, {num_shared * width}] for "
                         f"{num_shared} experts of width {width}")
    gate, up = gate_up.view(2, num_shared, width, hidden).unbind(0)  # [S, I, H] each
    shared_w13 = torch.cat([gate, up], dim=1)  # [S, 2I, H]
    shared_w2 = down.view(hidden, num_shared, width).transpose(0, 1)  # [S, H, I]
    return torch.cat([w13, shared_w13]), torch.cat([w2, shared_w2])


# Up to this many (token, expert) pairs the bf16 experts run in the Triton fused MoE, above it in
# experts_grouped. Set by bench_moe on an H200 (V2-Lite layer, CUDA graphs): the fused MoE took 0.33x
# grouped_mm's time at 1 token, 0.6x at 64, 0.68x at 1024 and 0.89x at 8192 (the largest measured,
# 49152 pairs), its lead shrinking as the work turns compute-bound; larger batches are unmeasured.
FUSED_MOE_MAX_PAIRS = 8192 * 6


@torch.library.custom_op("encore::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, num_shared: int) -> torch.Tensor:
    """The routed experts as one op the compiler does not trace into. CPU: the reference (its host
    reads cost nothing there); CUDA: a capturable kernel — the Triton fused MoE up to
    FUSED_MOE_MAX_PAIRS pairs and for every dtype ``torch._grouped_mm`` lacks, ``experts_grouped``
    for larger bf16 batches. ``num_shared``: the fused shared experts ending each token's pairs, as
    ``route(..., num_shared)`` appends them (``moe_triton.fused_moe`` starts them early, so with it
    this op must follow ``route`` directly)."""
    return experts_torch(x, w13, w2, weights, ids)


@routed_experts.register_kernel("cuda")
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
      num_shared: int) -> torch.Tensor:
    if x.dtype == torch.bfloat16 and ids.numel() > FUSED_MOE_MAX_PAIRS:  # bf16: grouped_mm's only GPU dtype
        return experts_grouped(x, w13, w2, weights, ids)
    from encore.backends.moe_triton import fused_moe  # triton is imported on first use

    return fused_moe(x, w13, w2, weights, ids, num_shared)


@routed_experts.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
      num_shared: int) -> torch.Tensor:
    return torch.empty_like(x)
