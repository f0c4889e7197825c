"""The attention backend interface: what a backend can do, and the two calls the runner makes."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from encore.backends import mla_ops  # noqa: F401  (registers torch.ops.encore.*, which backends serve)
from encore.backends.metadata import ForwardBatch, ForwardMode


def decompress_kv(kv: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, rank: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The MHA keys and values of gathered latents, in ``kv``'s dtype: kv [S, R + dr], w_kc [H, dn, R],
    w_vc [H, dv, R] -> k [S, H, dn + dr] (the shared rope part broadcast to every head), v [S, H, dv]."""
    dtype = kv.dtype
    k_nope = torch.einsum("sr,hdr->shd", kv[:, :rank], w_kc.to(dtype))  # [S, H, dn]
    k_pe = kv[:, None, rank:].expand(-1, k_nope.shape[1], -1)  # [S, H, dr]
    v = torch.einsum("sr,hvr->shv", kv[:, :rank], w_vc.to(dtype)).contiguous()  # [S, H, dv]
    return torch.cat([k_nope, k_pe], dim=-1), v


@dataclass(frozen=True, slots=True)
class MLADims:
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    softmax_scale: float

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def absorbed_prefill_is_cheaper(self, q_lens: list[int], prefix_lens: list[int]) -> bool:
        """Whether prefill rows of ``q_lens`` new tokens after ``prefix_lens`` cached ones cost fewer FLOPs
        as absorbed MLA over the latent cache than as MHA over their decompressed KV. Both project the
        new tokens' latents once (MHA: their K and V; absorbed: q·W_kc and o·W_vc); MHA also decompresses
        every prefix latent (R·H·(dn + dv) MACs each), while absorbed attends with 576-wide keys and
        512-wide values instead of 192 and 128 (H·(2R − dn − dv) more MACs per visible (query, key)
        pair). So a long cached prefix under a few new tokens (a prompt that starts from the prefix
        cache) goes absorbed, a long new prompt MHA."""
        r, h = self.kv_lora_rank, self.num_heads
        decompress = sum(prefix_lens) * r * h * (self.qk_nope_head_dim + self.v_head_dim)
        pairs = sum(q * (p + (q + 1) / 2) for q, p in zip(q_lens, prefix_lens))
        return decompress > pairs * h * (2 * r - self.qk_nope_head_dim - self.v_head_dim)


class AttentionBackend(abc.ABC):
    """MLA attention over the paged latent cache with the split dispatch of DESIGN.md.

    Capabilities (one flag is not enough, vLLM #25984):
    ``supports_spec_as_decode``: decode rows with a uniform q_len_per_req > 1 (causal inside the row);
    ``supports_nonuniform_decode``: decode rows of different lengths;
    ``graph_modes``: the ForwardModes whose steps may be captured in a CUDA graph.
    """

    name: str
    supports_spec_as_decode: bool
    supports_nonuniform_decode: bool
    graph_modes: frozenset[ForwardMode]

    def __init__(self, kv_caches: list[torch.Tensor], dims: MLADims) -> None:
        for i, cache in enumerate(kv_caches):
            if cache.dim() != 3 or cache.shape[-1] != dims.latent_dim:
                raise ValueError(f"kv cache {i} has shape {tuple(cache.shape)}; expected "
                                 f"[num_pages, page_size, {dims.latent_dim}]")
        self.kv_caches = kv_caches
        self.dims = dims
        # Steps this backend's own kernels could not take and ran on another path: reported in the
        # engine's stats (``attention_fallback_steps``), never silent.
        self.fallback_steps = 0

    @property
    def slow_replans(self) -> int:
        """Graph-step plans that took a backend's slower general planner where it has a fast one for
        re-planning a graph's shape (reported as ``attention_slow_replans``)."""
        return 0

    @property
    def triton_decode_steps(self) -> int:
        """Steps whose decode rows a backend ran on encore's Triton decode kernel because it is faster
        for their shape (reported as ``attention_triton_decode_steps``)."""
        return 0

    def warm_up_decode(self, q_len: int) -> int:
        """Compiles, by launching them on scratch inputs, the decode kernel variants this backend can pick
        for rows of ``q_len`` tokens that a warm-up step's shape would not reach; returns the launches.
        Called once at start-up (ModelRunner.warm_up_kernels) on CUDA; none by default."""
        return 0

    def plan(self, batch: ForwardBatch, static: bool = False) -> None:
        """Host-side metadata for the step, prefill rows and decode rows planned separately.

        Runs outside any compiled graph, before every forward (and before every CUDA-graph replay,
        with the graph's static batch). ``static``: the batch is a graph key's static step, whose
        shapes (and, once captured, buffers) recur; a backend may keep per-shape state for it."""

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
               cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch) -> None:
        """Both branches: the prefill tokens [:num_extend_tokens], then the decode tokens, each into its
        slice of ``out``. The dispatch-split pass does the same split inside a compiled graph."""
        split = batch.num_extend_tokens
        if batch.num_extends:
            self.prefill(q_nope[:split], q_pe[:split], w_kc, w_vc, cache, out[:split], batch)
        if batch.num_decodes:
            self.decode(q_nope[split:], q_pe[split:], w_kc, w_vc, cache, out[split:], batch)

    @abc.abstractmethod
    def prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch) -> None:
        """MHA over the decompressed KV of rows [:num_extends]; q [n, H, *] -> out [n, H, dv].

        n is the step's extend-token count, bucket padding included: tokens [qo_indptr[num_extends], n)
        are padding that belongs to no row (graphs/padding.py). Their output rows are dropped, but
        must be finite (write zeros, or anything finite): their latents land on the dummy page,
        which every real row reads masked, and a NaN there would survive a zero attention weight."""

    @abc.abstractmethod
    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
               cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch, q_lat: torch.Tensor | None = None) -> None:
        """Absorbed MLA over the latent cache for rows [num_extends:], each q_len_per_req tokens.
        ``q_lat`` [T, H, R] contiguous: the latent query q_nope · w_kc, already computed
        (``mla_ops.rope_absorb``), which the Triton and flashinfer backends take instead of absorbing
        again; the torch reference absorbs in float32 itself."""
