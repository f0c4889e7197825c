"""Rotary position embedding for the rope slice of MLA queries and keys (default and YaRN)."""

from __future__ import annotations

import math

import torch
from torch import nn

from encore.models.config import RopeConfig, yarn_mscale


def inverse_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [dim / 2], attention factor applied to cos/sin)."""
    exponents = torch.arange(0, rope.dim, 2, dtype=torch.float32) / rope.dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "default":
        return inv_freq, 1.0
    # YaRN: interpolate the low frequencies, keep the high ones, blend linearly in between.
    low, high = _yarn_correction_range(rope)
    ramp = ((torch.arange(rope.dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1.0 - ramp  # 1 where the frequency is extrapolated (kept as is)
    inv_freq = inv_freq / rope.factor * (1.0 - keep) + inv_freq * keep
    factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return inv_freq, factor


def _yarn_correction_range(rope: RopeConfig) -> tuple[float, float]:
    def dim_of(rotations: float) -> float:
        return (rope.dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low = math.floor(dim_of(rope.beta_fast))
    high = math.ceil(dim_of(rope.beta_slow))
    return max(low, 0), min(high, rope.dim - 1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q_pe [T, H, d] and k_pe [T, d] at the given positions.

    Interleaved checkpoints (DeepSeek's default) rotate pairs (x0, x1), (x2, x3), ...; the output is
    written de-interleaved ([all first halves, all second halves]). Queries and keys get the same
    permutation, so attention scores are unchanged and the cache holds the de-interleaved form.
    """

    def __init__(self, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        self.rope = rope
        self.max_positions = max_positions
        self.interleaved = rope.interleaved
        self.register_buffer("cos_sin", torch.empty(max_positions, rope.dim), persistent=False)
        if not self.cos_sin.is_meta:
            self.init_buffers()

    def init_buffers(self) -> None:
        """Fills the cos/sin table; the loader calls it after materializing a meta-built model."""
        inv_freq, factor = inverse_frequencies(self.rope)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)  # [P, d / 2]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor
        self.cos_sin = table.to(device=self.cos_sin.device, dtype=torch.float32)

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # An op rather than inline math so that the pre-attention fusion pass can find it and fuse it
        # with the latent-cache write that consumes k_pe.
        return torch.ops.encore.rotary(positions, q_pe, k_pe, self.cos_sin, self.interleaved)


def apply_rotary(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor, cos_sin: torch.Tensor,
                 interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference RoPE: q_pe [T, H, d], k_pe [T, d], cos_sin [P, d] -> rotated (q_pe, k_pe)."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, d / 2] each
    return rotate(q_pe, cos[:, None], sin[:, None], interleaved), rotate(k_pe, cos, sin, interleaved)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [..., d] rotated by angles given as cos, sin [..., d / 2] (broadcast), computed in float32;
    ``interleaved``: pairs are (0, 1), (2, 3)… rather than the two halves."""
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@torch.library.custom_op("encore::rotary", mutates_args=())
def rotary(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor, cos_sin: torch.Tensor,
           interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary(positions, q_pe, k_pe, cos_sin, interleaved)


@rotary.register_fake
def _(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor, cos_sin: torch.Tensor,
      interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q_pe), torch.empty_like(k_pe)
