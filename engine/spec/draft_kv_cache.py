"""The EAGLE-3 drafter's paged KV cache and its attention (plain torch; a custom op in decode steps).

The cache is indexed exactly like the target's latent cache — same pages, page tables and slot
mapping (``page * page_size + offset``) — so it needs no allocator of its own: a request's pages
already cover every position the drafter writes (the step's tokens plus the k - 1 lookahead the
scheduler reserves for model drafters), and pages freed by the target are free for the drafter too.
Layout ``[num_pages, page_size, 2, Hkv, d]``: a token's K and V side by side, one write per token.
Page 0 is the dummy page, as for the target (never read unmasked).

Attention follows the step layout (backends/metadata.py): prefill rows are ragged — every prefill
token attends to its own row's keys up to its position, one masked SDPA over the rows' gathered
pages; decode rows are uniform — one batched SDPA, query i of a row attending to the row's keys up
to its own position (the prefix, then causal within the row). GQA through SDPA's ``enable_gqa``.
Like the torch MLA backend it reads every page of the page table, masked past each position.

A decode-only step (all a compiled drafter runs, graphs/compiler.py ``CompiledDrafter``) writes and
attends in one custom op, ``encore::draft_decode_attention``, whose fake output is shaped like q: the
rows and q_len are read from its tensors' sizes inside it, so dynamo keeps the token count, the rows
and the table's width symbolic instead of specializing on them through the masks and views.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encore.backends.metadata import ForwardBatch
from encore.backends.torch_backend import ragged_prefill_mask
from encore.engine.kv_cache import zeroed_pool


class DraftKVCache:
    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cache = zeroed_pool((num_pages, page_size, 2, num_kv_heads, head_dim), dtype, device)
        self.scale = head_dim ** -0.5

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, d], k / v [T, Hkv, d] (RoPE applied) -> [T, Hq, d]; writes k, v at the step's slots
        first, so that every query sees its own key."""
        kv_heads, head_dim = self.cache.shape[-2:]
        if k.shape[1:] != (kv_heads, head_dim) or q.shape[0] != batch.slot_mapping.shape[0]:
            raise ValueError(f"draft attention got q {tuple(q.shape)} and k {tuple(k.shape)} for "
                             f"{batch.slot_mapping.shape[0]} slots; the cache holds {kv_heads} heads of {head_dim}")
        if not batch.num_extends:
            return draft_decode_attention(q, k, v, self.cache, batch.slot_mapping, batch.page_table,
                                          batch.positions, self.scale)
        _write(self.cache, k, v, batch.slot_mapping)
        out = torch.empty_like(q)
        split = batch.num_extend_tokens
        out[:split] = self._prefill(q[:split], batch)
        if batch.num_decodes:
            out[split:] = _decode(q[split:], self.cache, batch.page_table[batch.num_extends:],
                                  batch.positions[split:], self.scale)
        return out

    def _prefill(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        kv = self.cache[batch.page_table[:batch.num_extends]].flatten(1, 2)  # [E, S, 2, Hkv, d]
        mask = ragged_prefill_mask(batch, q.shape[0], kv.shape[1])  # [n, E * S]
        k = kv[:, :, 0].flatten(0, 1).transpose(0, 1)  # [Hkv, E * S, d]
        v = kv[:, :, 1].flatten(0, 1).transpose(0, 1)  # [Hkv, E * S, d]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=self.scale,
                                           enable_gqa=True)  # [Hq, n, d]
        return o.transpose(0, 1)


def _write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kv_heads, head_dim = cache.shape[-2:]
    cache.view(-1, 2, kv_heads, head_dim)[slot_mapping] = torch.stack([k, v], dim=1).to(cache.dtype)


def _decode(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Uniform decode rows: q [B * q_len, Hq, d], page_table [B, P], positions [B * q_len] -> [B * q_len, Hq, d]."""
    rows = page_table.shape[0]
    q_len = q.shape[0] // rows
    kv = cache[page_table].flatten(1, 2)  # [B, S, 2, Hkv, d]
    visible = torch.arange(kv.shape[1], device=q.device)[None, None, :] <= positions.view(rows, q_len)[..., None]
    o = F.scaled_dot_product_attention(
        q.view(rows, q_len, *q.shape[1:]).transpose(1, 2),  # [B, Hq, q, d]
        kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2),  # [B, Hkv, S, d]
        attn_mask=visible[:, None], scale=scale, enable_gqa=True)  # [B, Hq, q, d]
    return o.transpose(1, 2).flatten(0, 1)


@torch.library.custom_op("encore::draft_decode_attention", mutates_args=("cache",))
def draft_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                           slot_mapping: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """A decode-only step's K/V write at ``slot_mapping`` and its attention (``_decode``), contiguous as
    the fake says (SDPA's output layout differs between devices and kernels)."""
    _write(cache, k, v, slot_mapping)
    return _decode(q, cache, page_table, positions, scale).contiguous()


@draft_decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
      page_table: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)
