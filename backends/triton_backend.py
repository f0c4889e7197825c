"""The Triton attention backend: encore's own MLA kernels (``triton_mla``) behind the backend interface."""

from __future__ import annotations

import torch

from encore.backends.base import AttentionBackend, MLADims, decompress_kv
from encore.backends.metadata import ForwardBatch, ForwardMode
from encore.backends.triton_mla import choose_num_kv_splits, default_decode_config, mla_decode, mla_prefill

# The Triton interpreter has no SMs; 8 keeps split-KV exercised when the backend runs on CPU tensors.
_INTERPRETER_SMS = 8


class TritonAttentionBackend(AttentionBackend):
    """MLA on encore's Triton kernels, with static shapes and no host reads, so that every step layout
    can be captured in a CUDA graph. The same math as the torch reference, in the model's dtype:

    Decode rows: q_lat = q_nope·W_kc [T, H, R], the split-KV flash-decoding kernel over the latent
    cache into a [T, H, R] latent output, then ·W_vc into ``out``. Any uniform q_len_per_req. The
    number of KV splits is a function of static sizes only (rows, q_len, the page table's width), so a
    captured graph stays valid for any ``seq_lens``.
    Prefill rows: like the torch reference, each row's whole page-table span is read back from the
    latent cache and decompressed through W_kc / W_vc, so row b's keys sit at b·S .. b·S + S (S: the
    table's width in tokens, key j at position j) and kv_indptr is a device-side arange; the ragged
    causal kernel sees keys up to each query's position, which never reaches past the row's length.
    """

    name = "triton"
    supports_spec_as_decode = True
    supports_nonuniform_decode = False
    graph_modes = frozenset({ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.EXTEND})

    def __init__(self, kv_caches: list[torch.Tensor], dims: MLADims) -> None:
        super().__init__(kv_caches, dims)
        device = kv_caches[0].device if kv_caches else torch.device("cpu")
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else _INTERPRETER_SMS)

    def num_kv_splits(self, rows: int, q_len: int, max_pages: int, page_size: int) -> int:
        """Splits per decode row for a step of this shape; host ints only (a graph key fixes all four)."""
        block_m = default_decode_config(q_len, self.dims.num_heads).block_m
        return choose_num_kv_splits(rows, self.dims.num_heads, q_len, max_pages * page_size, self.num_sms, block_m)

    def prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch) -> None:
        rows = batch.num_extends
        if rows == 0:
            out.zero_()
            return
        kv = cache[batch.page_table[:rows]].flatten(0, 2).to(q_nope.dtype)  # [E * S, R + dr]
        span = kv.shape[0] // rows
        k, v = decompress_kv(kv, w_kc, w_vc, self.dims.kv_lora_rank)  # [E * S, H, dn + dr], [E * S, H, dv]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [n, H, dn + dr]
        kv_indptr = torch.arange(rows + 1, device=q.device, dtype=torch.int32) * span  # [E + 1]
        out.zero_()  # the kernel leaves tokens no row owns (bucket padding) untouched: make them finite
        mla_prefill(q, k, v, batch.qo_indptr[:rows + 1], kv_indptr, batch.prefix_lens[:rows],
                    self.dims.softmax_scale, out)

    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
               cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch) -> None:
        rows, q_len = batch.num_decodes, batch.q_len_per_req
        pages = batch.page_table[batch.num_extends:]  # [B, P]
        dtype = q_nope.dtype
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_kc.to(dtype)).contiguous()  # [T, H, R]
        o_lat = torch.empty_like(q_lat)  # [T, H, R]
        splits = self.num_kv_splits(rows, q_len, pages.shape[1], cache.shape[1])
        mla_decode(q_lat, q_pe, cache, pages, batch.seq_lens[batch.num_extends:], q_len,
                   self.dims.softmax_scale, o_lat, num_kv_splits=splits)
        out.copy_(torch.einsum("thr,hvr->thv", o_lat, w_vc.to(dtype)))  # [T, H, dv]
