"""The Triton attention backend: encore's own MLA kernels (``triton_mla``, ``triton_mla_prefill``) behind
the backend interface."""

from __future__ import annotations

import torch

from encore.backends.base import AttentionBackend, MLADims, decompress_kv
from encore.backends.dense import absorb_query
from encore.backends.metadata import ForwardBatch, ForwardMode
from encore.backends.triton_mla import mla_decode, warm_up_decode
from encore.backends.triton_mla_prefill import mla_prefill
from encore.engine.kv_cache import DUMMY_PAGE


class TritonAttentionBackend(AttentionBackend):
    """MLA on encore's Triton kernels, with static shapes and no host reads, so that every step layout
    can be captured in a CUDA graph. The same math as the torch reference, in the model's dtype:

    Decode rows: q_lat = q_nope·W_kc [T, H, R], the split-KV flash-decoding kernel over the latent
    cache into a [T, H, R] latent output, then ·W_vc into ``out`` (at one token the kernel's merge
    projects the values itself: ``mla_decode``'s ``w_vc``). Any uniform q_len_per_req. The
    kernel's launch settings and KV splits are functions of static sizes only (rows, q_len, the page
    table's width, the dtype), so a captured graph stays valid for any ``seq_lens``.
    Prefill rows take one of two paths, chosen by whether the step's shapes are static (as in the
    flashinfer backend):
    - an eager step: like the torch reference, each row's whole page-table span (the step's own width)
      is read back from the latent cache and decompressed through W_kc / W_vc, so row b's keys sit at
      b·S .. b·S + S (S: the table's width in tokens, key j at position j) and kv_indptr is a
      device-side arange; the ragged causal kernel sees keys up to each query's position, which never
      reaches past the row's length. MHA is the cheaper formulation for long new prompts.
    - a static step (a graph key's buffers, whose table is as wide as the longest row the engine
      allows): every prefill token is a decode row of its own with q_len 1, its row's pages and a
      length of its position + 1, through the absorbed decode kernel above. Each token reads its own
      row's keys up to its position (the kernel's loop ends at the length), where decompressing every
      padded row's whole span would read and expand ``num_extends`` × the longest row allowed.
    """

    name = "triton"
    supports_spec_as_decode = True
    supports_nonuniform_decode = False
    graph_modes = frozenset({ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.EXTEND})

    def __init__(self, kv_caches: list[torch.Tensor], dims: MLADims) -> None:
        super().__init__(kv_caches, dims)
        self._static = False  # the planned step's prefill path (class docstring)

    def warm_up_decode(self, q_len: int) -> int:
        # Launch settings follow the step's rows and table width (triton_mla.decode_launch): each is
        # launched here rather than found by trying step shapes.
        if not self.kv_caches:
            return 0
        return warm_up_decode(self.kv_caches[0], DUMMY_PAGE, self.dims.num_heads, q_len, self.dims.qk_rope_head_dim,
                              self.dims.v_head_dim, self.dims.softmax_scale)

    def plan(self, batch: ForwardBatch, static: bool = False) -> None:
        self._static = static

    def prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch) -> None:
        rows = batch.num_extends
        if rows == 0:
            out.zero_()
            return
        if self._static:
            tokens = q_nope.shape[0]  # the bucket: bucket padding past qo_indptr[rows] included
            # Each token's row; bucket padding (owned by none) reads the last row's first key: finite,
            # and its output is dropped.
            row = torch.searchsorted(batch.qo_indptr[1:rows + 1], torch.arange(tokens, device=q_nope.device),
                                     right=True).clamp_(max=rows - 1)
            seq_lens = (batch.positions[:tokens] + 1).to(torch.int32)  # keys 0..the token's position
            self._absorbed(q_nope, q_pe, w_kc, w_vc, cache, out, batch.page_table[row], seq_lens, 1)
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
               cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch, q_lat: torch.Tensor | None = None) -> None:
        self._absorbed(q_nope, q_pe, w_kc, w_vc, cache, out, batch.page_table[batch.num_extends:],
                       batch.seq_lens[batch.num_extends:], batch.q_len_per_req, q_lat)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                  cache: torch.Tensor, out: torch.Tensor, pages: torch.Tensor, seq_lens: torch.Tensor,
                  q_len: int, q_lat: torch.Tensor | None = None) -> None:
        """Absorbed MLA of rows of ``q_len`` tokens over their ``pages`` [B, P] up to ``seq_lens`` [B];
        ``q_lat``: their latent query, if already computed (by the one-token RoPE + absorb kernel, which
        releases the decode kernel only after its own wait: the tables, uploaded with the step or
        computed before it, are complete by then, ``mla_decode``'s ``tables_ready``)."""
        tables_ready = q_lat is not None
        if q_lat is None:
            q_lat = absorb_query(q_nope, w_kc)  # [T, H, R]
        mla_decode(q_lat, q_pe, cache, pages, seq_lens, q_len, self.dims.softmax_scale, out,
                   w_vc=w_vc.to(q_lat.dtype), tables_ready=tables_ready)
