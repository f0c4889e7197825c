"""The torch reference attention backend: the oracle every faster backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encore.backends.base import AttentionBackend
from encore.backends.metadata import ForwardBatch, ForwardMode


class TorchAttentionBackend(AttentionBackend):
    """Plain torch MLA on CPU or GPU, computed in float32, with static shapes and no host reads, so
    that it can be captured in a CUDA graph for every step layout.

    Prefill rows: each row's KV (cached prefix + this chunk) is read back from the latent cache
    through its page table, decompressed through kv_b_proj (W_kc, W_vc), and every prefill token
    attends to the keys of its own row up to its position (one masked SDPA for all prefill rows).
    Decode rows: the absorbed path — q_nope·W_kc gives a latent query, attention runs over the
    576-wide latent entries directly, and the latent output goes through W_vc; any uniform
    q_len_per_req, causal inside the row.
    Both read every page of the page table (masked past the row's length): cost follows the table's
    width, not the rows' lengths — fine for a reference.
    """

    name = "torch"
    supports_spec_as_decode = True
    supports_nonuniform_decode = False
    graph_modes = frozenset({ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.EXTEND})

    def prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch) -> None:
        rank = self.dims.kv_lora_rank
        num_tokens, heads = q_nope.shape[:2]
        rows = batch.num_extends
        kv = cache[batch.page_table[:rows]].flatten(1, 2).float()  # [E, S, R + dr]
        span = kv.shape[1]
        k_nope = torch.einsum("esr,hdr->hesd", kv[..., :rank], w_kc.float())  # [H, E, S, dn]
        v = torch.einsum("esr,hvr->hesv", kv[..., :rank], w_vc.float()).flatten(1, 2)  # [H, E * S, dv]
        k_pe = kv[None, ..., rank:].expand(heads, -1, -1, -1)  # [H, E, S, dr]
        k = torch.cat([k_nope, k_pe], dim=-1).flatten(1, 2)  # [H, E * S, dn + dr]
        mask = ragged_prefill_mask(batch, num_tokens, span)  # [n, E * S]
        q = torch.cat([q_nope, q_pe], dim=-1).float().transpose(0, 1)  # [H, n, dn + dr]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.dims.softmax_scale)
        out.copy_(o.transpose(0, 1))  # [n, H, dv]

    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
               cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch, q_lat: torch.Tensor | None = None) -> None:
        # The reference absorbs in float32 itself: a given q_lat (rounded to the model's dtype) is not used.
        rank = self.dims.kv_lora_rank
        rows, q_len = batch.num_decodes, batch.q_len_per_req
        pages = batch.page_table[batch.num_extends:]  # [B, P]
        kv = cache[pages].flatten(1, 2).float()  # [B, S_max, R + dr]
        seq_lens = batch.seq_lens[batch.num_extends:].long()  # [B]
        q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w_kc.float()).view(rows, q_len, -1, rank)
        q_rope = q_pe.float().view(rows, q_len, q_pe.shape[1], -1)
        scores = (torch.einsum("bqhr,bsr->bhqs", q_lat, kv[..., :rank])
                  + torch.einsum("bqhd,bsd->bhqs", q_rope, kv[..., rank:])) * self.dims.softmax_scale
        # Query i of a row sits at position seq_len - q_len + i and sees keys up to it.
        query_pos = seq_lens[:, None] - q_len + torch.arange(q_len, device=kv.device)  # [B, q]
        visible = torch.arange(kv.shape[1], device=kv.device)[None, None, :] <= query_pos[..., None]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        o_lat = torch.einsum("bhqs,bsr->bqhr", scores.softmax(dim=-1), kv[..., :rank])
        out.copy_(torch.einsum("bqhr,hvr->bqhv", o_lat, w_vc.float()).flatten(0, 1))


def ragged_prefill_mask(batch: ForwardBatch, num_tokens: int, span: int) -> torch.Tensor:
    """[n, E * S] bool for the first ``num_tokens`` (prefill) tokens against the prefill rows' keys
    gathered row after row, S = ``span`` positions each: a token sees its own row's keys up to its
    position. A token belongs to the row whose qo range holds it; bucket padding past the last range
    is attended as the last row's token at position 0: it sees one written key, so stays finite."""
    rows, device = batch.num_extends, batch.positions.device
    token_ids = torch.arange(num_tokens, device=device, dtype=batch.qo_indptr.dtype)
    token_row = torch.searchsorted(batch.qo_indptr[1:rows + 1], token_ids, right=True).clamp_(max=rows - 1)
    key_row = torch.arange(rows, device=device).repeat_interleave(span)  # [E * S]
    key_pos = torch.arange(span, device=device).repeat(rows)  # [E * S]
    query_pos = batch.positions[:num_tokens]
    return (key_row[None, :] == token_row[:, None]) & (key_pos[None, :] <= query_pos[:, None])
