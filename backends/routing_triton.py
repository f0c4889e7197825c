"""Triton expert selection: the CUDA kernel of ``encore::route`` (moe.py).

DeepSeek's routing after the router GEMM is a chain of small ops — softmax or sigmoid, the correction
bias, per-group scores and the group top-k, the expert top-k, a gather and the normalization — which
compile to four to six launches per MoE layer (torch's top-k alone is one to three kernels). Here it
is one: each program takes one token's router logits [1, E] (float32) on one warp and does all of it
in registers, writing weights [T, k] float32 and ids [T, k] int64 for ``encore::routed_experts``.

Same math as ``moe.select_experts``; where the reference leaves an order open, this kernel picks:
ids come best first, and among equal choice scores (or equal group scores) the lowest index wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from encore.backends import kernel_variants
from encore.backends.pdl import pdl_supported
from encore.backends.triton_common import check


@kernel_variants.watched
@triton.jit
def _select_kernel(LOGITS, BIAS, WEIGHTS, IDS, scaling,
                   E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                   SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, NOAUX_TC: tl.constexpr, RENORMALIZE: tl.constexpr,
                   NUM_SHARED: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched as a programmatic dependent: the router's logits are read after their kernel finished,
        # and a programmatic dependent after it (one token's gate_up kernel) launches now. The order is
        # load-bearing: gate_up's shared-expert programs read x as they start, and x is complete only once
        # this wait has returned.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) + tl.arange(0, 1)  # the token, as a one-row tile
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    logits = tl.load(LOGITS + rows[:, None] * E + cols[None, :], mask=col_ok[None, :], other=0.0)
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        logits = tl.where(col_ok[None, :], logits, float("-inf"))
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(col_ok[None, :], choice, float("-inf"))
    if N_GROUP > 1:
        group_of = cols // (E // N_GROUP)
        gcols = tl.arange(0, BLOCK_G)
        group_score = tl.full([1, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            member = tl.where((group_of == g)[None, :], choice, float("-inf"))
            best = tl.max(member, axis=1)
            if NOAUX_TC:  # the sum of the group's two best
                first = tl.min(tl.where(member == best[:, None], cols[None, :], BLOCK_E), axis=1)
                best += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), member), axis=1)
            group_score = tl.where(gcols[None, :] == g, best[:, None], group_score)
        kept = tl.zeros([1, BLOCK_E], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, axis=1)
            gid = tl.min(tl.where(group_score == best[:, None], gcols[None, :], BLOCK_G), axis=1)
            kept = tl.where(group_of[None, :] == gid[:, None], 1, kept)
            group_score = tl.where(gcols[None, :] == gid[:, None], float("-inf"), group_score)
        fill = float("-inf") if NOAUX_TC else 0.0
        choice = tl.where(kept != 0, choice, tl.where(col_ok[None, :], fill, float("-inf")))
    kcols = tl.arange(0, BLOCK_K)
    weights = tl.zeros([1, BLOCK_K], tl.float32)
    ids = tl.zeros([1, BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        # A NaN score matches nothing: the index is clamped, so a NaN row still reads a real expert.
        idx = tl.minimum(tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), axis=1), E - 1)
        hit = cols[None, :] == idx[:, None]
        if HAS_BIAS or N_GROUP > 1:
            picked = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        else:  # the choice is the score: the pick's weight is its best, with no reduction of its own
            picked = best
        weights = tl.where(kcols[None, :] == j, picked[:, None], weights)
        ids = tl.where(kcols[None, :] == j, idx[:, None].to(tl.int64), ids)
        choice = tl.where(hit, float("-inf"), choice)
    if SIGMOID:
        if RENORMALIZE:
            weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
        weights = weights * scaling
    elif RENORMALIZE and TOP_K > 1:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    else:
        weights = weights * scaling
    # Shared experts fused into the routed ones: experts E..E + NUM_SHARED - 1, weight 1, after the top-k.
    weights = tl.where(kcols[None, :] >= TOP_K, 1.0, weights)
    ids = tl.where(kcols[None, :] >= TOP_K, (E + kcols - TOP_K)[None, :].to(tl.int64), ids)
    out = rows[:, None] * (TOP_K + NUM_SHARED) + kcols[None, :]
    store = (kcols < TOP_K + NUM_SHARED)[None, :]
    tl.store(WEIGHTS + out, weights, mask=store)
    tl.store(IDS + out, ids, mask=store)


def select_experts_triton(router_logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring_func: str,
                          topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool,
                          routed_scaling_factor: float, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.select_experts`` in one launch: router_logits [T, E] float32 -> (weights [T, k + S] float32,
    ids [T, k + S] int64), where the last S = ``num_shared`` columns are the shared experts fused into
    the routed ones (``moe.with_shared_experts``): ids E..E + S - 1, weight 1."""
    check(router_logits.dim() == 2 and router_logits.dtype == torch.float32 and router_logits.is_contiguous(),
          f"router_logits {tuple(router_logits.shape)} {router_logits.dtype}: expected contiguous [T, E] float32")
    tokens, experts = router_logits.shape
    check(0 < top_k <= experts, f"top_k={top_k}: must be in 1..{experts} (the number of experts)")
    check(scoring_func in ("softmax", "sigmoid"), f"scoring_func {scoring_func!r}: expected 'softmax' or 'sigmoid'")
    grouped = topk_method in ("group_limited_greedy", "noaux_tc") and n_group > 1
    if grouped:
        check(experts % n_group == 0 and 0 < topk_group <= n_group,
              f"n_group={n_group}, topk_group={topk_group}: E={experts} must split into n_group equal groups, "
              f"of which 1..n_group are kept")
    if bias is not None:
        check(bias.shape == (experts,), f"bias {tuple(bias.shape)}: expected [{experts}]")
    check(num_shared >= 0, f"num_shared={num_shared}: must be >= 0")
    weights = torch.empty(tokens, top_k + num_shared, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k + num_shared, dtype=torch.int64, device=router_logits.device)
    block_e = max(16, triton.next_power_of_2(experts))
    pdl = pdl_supported(router_logits.device)
    if tokens:  # a program of one warp per token: every reduction stays in the warp. Tiles of 32 tokens on
        # four warps took 5.0-5.2 µs a call at 2-256 tokens of V2-Lite's 64 experts against 1.6-1.8, and
        # 23.5 against 3.2-3.4 at V3's 256 (H200, CUDA graphs, session 31); at 8192 tokens 6.0 against
        # 10.2 (64 experts) and 55.6 against 20.5 (256), the one place a tile won, by 4 µs a prefill layer.
        _select_kernel[(tokens,)](
            router_logits, bias if bias is not None else router_logits, weights, ids,
            float(routed_scaling_factor), E=experts, BLOCK_E=block_e, TOP_K=top_k,
            BLOCK_K=max(2, triton.next_power_of_2(top_k + num_shared)), SIGMOID=scoring_func == "sigmoid",
            HAS_BIAS=bias is not None, N_GROUP=n_group if grouped else 1,
            BLOCK_G=max(2, triton.next_power_of_2(n_group)), TOPK_GROUP=topk_group,
            NOAUX_TC=topk_method == "noaux_tc", RENORMALIZE=bool(norm_topk_prob), NUM_SHARED=num_shared,
            PDL=pdl, num_warps=1, launch_pdl=pdl)
    return weights, ids
