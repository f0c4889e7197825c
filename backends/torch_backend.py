"""The torch reference attention backend: the oracle every faster backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encore.backends.base import AttentionBackend
from encore.backends.metadata import ForwardBatch, ForwardMode


class TorchAttentionBackend(AttentionBackend):
    """Plain torch MLA on CPU or GPU, computed in float32.

    Prefill rows: the row's whole KV (cached prefix + this chunk) is read back from the latent
    cache, decompressed through kv_b_proj (W_kc, W_vc) and attended with causal SDPA.
    Decode rows: the absorbed path — q_nope·W_kc gives a latent query, attention runs over the
    576-wide latent entries directly, and the latent output goes through W_vc; any uniform
    q_len_per_req, causal inside the row.
    """

    name = "torch"
    supports_spec_as_decode = True
    supports_nonuniform_decode = False
    graph_modes = frozenset({ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.EXTEND})

    def forward(self, layer_id: int, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cache = self.kv_caches[layer_id]
        flat = cache.view(-1, cache.shape[-1])  # [slots, R + dr]
        flat[batch.slot_mapping] = torch.cat([kv_c, k_pe], dim=-1).to(cache.dtype)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_vc.shape[1])  # [T, H, dv]
        split = batch.num_extend_tokens
        if batch.num_extends:
            out[:split] = self._prefill(cache, q_nope[:split], q_pe[:split], w_kc, w_vc, batch)
        if batch.num_decodes:
            out[split:] = self._decode(cache, q_nope[split:], q_pe[split:], w_kc, w_vc, batch)
        return out

    def _prefill(self, cache: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor,
                 w_vc: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rank = self.dims.kv_lora_rank
        page_size = cache.shape[1]
        outs = []
        start = 0
        for row in range(batch.num_extends):
            prefix, seq_len = batch.prefix_lens_cpu[row], batch.seq_lens_cpu[row]
            q_len = seq_len - prefix
            num_pages = -(-seq_len // page_size)
            kv = cache[batch.page_table[row, :num_pages]].flatten(0, 1)[:seq_len].float()  # [S, R + dr]
            k_nope = torch.einsum("sr,hdr->hsd", kv[:, :rank], w_kc.float())  # [H, S, dn]
            v = torch.einsum("sr,hvr->hsv", kv[:, :rank], w_vc.float())  # [H, S, dv]
            k = torch.cat([k_nope, kv[None, :, rank:].expand(k_nope.shape[0], -1, -1)], dim=-1)
            q = torch.cat([q_nope[start:start + q_len], q_pe[start:start + q_len]], dim=-1).float()
            q = q.transpose(0, 1)  # [H, q_len, dn + dr]
            query_pos = torch.arange(prefix, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [q_len, S]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.dims.softmax_scale)
            outs.append(o.transpose(0, 1))  # [q_len, H, dv]
            start += q_len
        return torch.cat(outs).to(q_nope.dtype)

    def _decode(self, cache: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor,
                w_vc: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
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
        out = torch.einsum("bqhr,hvr->bqhv", o_lat, w_vc.float())
        return out.flatten(0, 1).to(q_nope.dtype)
