"""Verify a step's drafts against the target: greedy and stochastic acceptance, no host sync.

A verify row fed ``[t, d_1 .. d_k]`` gets ``k + 1`` target distributions ``p_0 .. p_k``; ``p_j``
predicts the token after position j. Draft ``d_i`` is checked against ``p_{i-1}``.

Stochastic (Leviathan et al. / Chen et al.): accept ``d_i`` with probability
``min(1, p(d_i) / q(d_i))``; at the first rejection emit a token drawn from
``norm(max(0, p - q))``; if all k are accepted, emit a bonus token drawn from ``p_k``. Drafters
without a distribution (n-gram, replay) propose deterministically: q is one-hot at the draft, so
acceptance is ``p(d_i)`` and the residual is p with ``d_i`` removed. Greedy rows (one-hot p) reduce
to "longest prefix equal to the target's argmax, then the target's token".

A row may cap how many of its drafts count (``max_accept``): drafts past the cap were never
proposed (a request that opted out of speculation has cap 0), so a row that reaches its cap emits a
token drawn from the target's own ``p_cap``, exactly as a plain decode row would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encore.engine.sampler import SAMPLE_SALT, sample_from_probs, seeded_uniform

ACCEPT_SALT = 1  # uniforms of the accept/reject tests
DRAFT_SALT = 2  # draws of a stochastic drafter; independent of the target's own draws


@dataclass(frozen=True, slots=True)
class Verdict:
    """``tokens[b, :num_accepted[b] + 1]`` are row b's emitted tokens (accepted drafts, then the
    correction or bonus token); entries past that are meaningless."""

    num_accepted: torch.Tensor  # [B] int64, 0..k
    tokens: torch.Tensor  # [B, k + 1] int64


def verify(target_probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
           seeds: torch.Tensor, counters: torch.Tensor, max_accept: torch.Tensor | None = None) -> Verdict:
    """target_probs [B, k + 1, V] (processed, greedy rows one-hot), drafts [B, k] int64,
    draft_probs [B, k, V] or None (deterministic drafter), seeds / counters [B] (counter of the
    row's first emitted token), max_accept [B] int64 in 0..k or None (no cap). Every random number
    is keyed by (seed, counter + position)."""
    rows, k1, vocab = target_probs.shape
    k = k1 - 1
    positions = torch.arange(k1, device=drafts.device)
    p_draft = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(-1)  # [B, k]
    if draft_probs is None:
        ratio = p_draft
        q = torch.zeros_like(target_probs[:, :k]).scatter_(2, drafts[..., None], 1.0)  # [B, k, V]
    else:
        q = draft_probs.float()
        q_draft = q.gather(2, drafts[..., None]).squeeze(-1)  # [B, k]
        ratio = p_draft / q_draft.clamp_min(1e-30)
    u = _uniforms(seeds, counters, k)  # [B, k]
    num_accepted = _leading_accepted(u < ratio.clamp(max=1.0), max_accept)  # [B]
    residual = torch.cat([(target_probs[:, :k] - q).clamp_min(0.0), target_probs[:, k:]], dim=1)  # [B, k+1, V]
    row_ids = torch.arange(rows, device=drafts.device)
    at = residual[row_ids, num_accepted]  # [B, V]
    p_at = target_probs[row_ids, num_accepted]  # [B, V]
    # A residual can be all-zero only through rounding when p == q; p itself is then exact. A row
    # stopped by its cap tested no draft there: it samples p itself.
    use_p = at.sum(dim=-1, keepdim=True) <= 0
    if max_accept is not None:
        use_p |= (num_accepted == max_accept)[:, None]
    at = torch.where(use_p, p_at, at)
    extra = sample_from_probs(at, seeds, counters + num_accepted, SAMPLE_SALT)  # [B]
    tokens = torch.cat([drafts, extra[:, None]], dim=1)  # [B, k + 1]
    tokens = torch.where(positions[None, :] == num_accepted[:, None], extra[:, None], tokens)
    return Verdict(num_accepted, tokens)


def verify_greedy(target_tokens: torch.Tensor, drafts: torch.Tensor, max_accept: torch.Tensor | None = None
                  ) -> Verdict:
    """``verify`` for rows that are all greedy, from the target's picks alone: target_tokens
    [B, k + 1] (the argmax after each position), drafts [B, k], max_accept as in ``verify``. Draft i
    is accepted while it equals the target's pick; the row then emits the target's own picks — the
    accepted drafts, then the correction (or bonus) token."""
    return Verdict(_leading_accepted(drafts == target_tokens[:, :drafts.shape[1]], max_accept), target_tokens)


def _leading_accepted(accepted: torch.Tensor, max_accept: torch.Tensor | None) -> torch.Tensor:
    """Drafts each row accepts [B]: the leading run of ``accepted`` [B, k], cut at ``max_accept``."""
    if max_accept is not None:
        accepted = accepted & (torch.arange(accepted.shape[1], device=accepted.device)[None, :] < max_accept[:, None])
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _uniforms(seeds: torch.Tensor, counters: torch.Tensor, k: int) -> torch.Tensor:
    """u[b, i] for the test of draft i + 1: keyed by the counter of the token it would become."""
    if k == 0:
        return seeds.new_zeros(seeds.shape[0], 0, dtype=torch.float32)
    steps = counters[:, None] + torch.arange(k, device=seeds.device)[None, :]  # [B, k]
    return seeded_uniform(seeds.repeat_interleave(k), steps.flatten(), 1, ACCEPT_SALT).view(-1, k)
