"""The custom ops of the attention path: what a compiled graph sees of the latent cache and of MLA.

Inductor must not look inside these (the metadata they read changes every step, and on the GPU
they launch Triton / flashinfer kernels), so each is a ``torch.library.custom_op`` with a fake
implementation. They take the tensors the graph computes and the layer's cache; the step's metadata
(slot mapping, page tables, sequence lengths, a backend's planned state) comes from the step context
(``encore.backends.context``). Outputs that the graph preallocates are written in place and declared
in ``mutates_args``; the cache is an argument of every op that writes or reads it, so the graph
orders the write before the read.

    write_latent_cache(kv_c, k_pe, cache)                      cache[slot] = [kv_c | k_pe]
    rope_cache_write(positions, q_pe, kv_c, k_pe, cos_sin,     RoPE of q_pe and k_pe, and the cache
                     cache, interleaved[, kv_norm_weight,      write, in one op (passes/ fuse to it;
                     eps]) -> q_pe_rot                         with the kv norm in front)
    rope_absorb(positions, q_nope, q_pe, kv_c, k_pe, cos_sin,  the same and the latent query
                w_kc, cache, interleaved[, ...])               q_nope·w_kc (DECODE graphs: one launch
                -> (q_pe_rot, q_lat)                           at one token)
    mla_attention(q_nope, q_pe, w_kc, w_vc, cache, out)        generic: both branches of the step
    mla_prefill(...same...)                                    rows [:num_extends] (MHA branch)
    mla_decode(...same...[, q_lat])                            rows [num_extends:] (absorbed branch;
                                                               q_lat: the latent query, if computed)

``mla_attention`` is what the model emits (through ``latent_attention``); the dispatch-split pass
lowers it, per graph key, into ``mla_prefill`` over the first ``num_extend_tokens`` tokens and
``mla_decode`` over the rest. The model holds its layer's cache itself, so tracing never reaches
into the backend object (a precompiled graph saves whatever its guards reach, and a backend holds
kernel handles that do not serialize).
"""

from __future__ import annotations

import torch

from encore.backends.context import current_step
from encore.backends.dense import absorb_query, rms_norm, runs_batched_gemv
from encore.backends.rope import apply_rotary


def _check_tokens(name: str, tensor: torch.Tensor, num_tokens: int) -> None:
    if tensor.shape[0] != num_tokens:
        raise ValueError(f"{name} has {tensor.shape[0]} tokens but the bound step has {num_tokens}; "
                         "the graph and the step context disagree (was the batch padded to its key?)")


def _write(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    flat = cache.view(-1, cache.shape[-1])  # [slots, R + dr]
    flat.index_copy_(0, slot_mapping, torch.cat([kv_c, k_pe], dim=-1).to(cache.dtype))


@torch.library.custom_op("encore::write_latent_cache", mutates_args=("cache",))
def write_latent_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor) -> None:
    """kv_c [T, R], k_pe [T, dr] -> cache[slot_mapping[t]] (cache [pages, page_size, R + dr])."""
    batch = current_step().batch
    _check_tokens("kv_c", kv_c, batch.num_tokens)
    if kv_c.shape[-1] + k_pe.shape[-1] != cache.shape[-1]:
        raise ValueError(f"kv_c {tuple(kv_c.shape)} and k_pe {tuple(k_pe.shape)} do not fill a cache entry "
                         f"of width {cache.shape[-1]}")
    _write(kv_c, k_pe, cache, batch.slot_mapping)


@write_latent_cache.register_fake
def _(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor) -> None:
    return None


@torch.library.custom_op("encore::rope_cache_write", mutates_args=("cache",))
def rope_cache_write(positions: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                     cos_sin: torch.Tensor, cache: torch.Tensor, interleaved: bool,
                     kv_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """RoPE of q_pe [T, H, dr] and k_pe [T, dr] at ``positions``, and the write of [kv_c | rope(k_pe)]
    into the cache; returns rope(q_pe). With ``kv_norm_weight``, kv_c is first normalized
    (``dense.rms_norm``: passes/fuse_norms.py folds the kv norm in). The torch reference: exactly
    (norm,) rotary + write_latent_cache."""
    batch = current_step().batch
    _check_tokens("q_pe", q_pe, batch.num_tokens)
    if kv_norm_weight is not None:
        kv_c = rms_norm(kv_c, kv_norm_weight, eps)
    q_rot, k_rot = apply_rotary(positions, q_pe, k_pe, cos_sin, interleaved)
    _write(kv_c, k_rot, cache, batch.slot_mapping)
    return q_rot


@rope_cache_write.register_kernel("cuda")
def _(positions: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, cos_sin: torch.Tensor,
      cache: torch.Tensor, interleaved: bool, kv_norm_weight: torch.Tensor | None = None,
      eps: float = 0.0) -> torch.Tensor:
    from encore.backends.rope_cache_triton import rope_cache_write_triton  # triton is imported on first use

    batch = current_step().batch
    _check_tokens("q_pe", q_pe, batch.num_tokens)
    return rope_cache_write_triton(positions, q_pe, kv_c, k_pe, cos_sin, cache, batch.slot_mapping, interleaved,
                                   kv_norm_weight, eps)


@rope_cache_write.register_fake
def _(positions: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, cos_sin: torch.Tensor,
      cache: torch.Tensor, interleaved: bool, kv_norm_weight: torch.Tensor | None = None,
      eps: float = 0.0) -> torch.Tensor:
    return torch.empty_like(q_pe)


@torch.library.custom_op("encore::rope_absorb", mutates_args=("cache",))
def rope_absorb(positions: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor, cos_sin: torch.Tensor, w_kc: torch.Tensor, cache: torch.Tensor, interleaved: bool,
                kv_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_cache_write`` and the latent query q_nope [T, H, dn] · w_kc [H, dn, R] per head [T, H, R]
    (contiguous, q_nope's dtype), which the decode then takes as it is (passes/fuse_rope_absorb.py):
    (rope(q_pe), q_lat). The torch reference: ``rope_cache_write`` and an einsum."""
    q_rot = rope_cache_write(positions, q_pe, kv_c, k_pe, cos_sin, cache, interleaved, kv_norm_weight, eps)
    return q_rot, torch.einsum("thd,hdr->thr", q_nope, w_kc.to(q_nope.dtype)).contiguous()


@rope_absorb.register_kernel("cuda")
def _(positions: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
      cos_sin: torch.Tensor, w_kc: torch.Tensor, cache: torch.Tensor, interleaved: bool,
      kv_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    from encore.backends.rope_cache_triton import rope_absorb_triton

    if q_nope.shape[0] != 1 or not runs_batched_gemv(1, w_kc):  # the two kernels, as the decode did
        q_rot = rope_cache_write(positions, q_pe, kv_c, k_pe, cos_sin, cache, interleaved, kv_norm_weight, eps)
        return q_rot, absorb_query(q_nope, w_kc)
    batch = current_step().batch
    _check_tokens("q_pe", q_pe, batch.num_tokens)
    return rope_absorb_triton(positions, q_nope, q_pe, kv_c, k_pe, cos_sin, w_kc, cache, batch.slot_mapping,
                              interleaved, kv_norm_weight, eps)  # one launch (rope_cache_triton.py)


@rope_absorb.register_fake
def _(positions: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
      cos_sin: torch.Tensor, w_kc: torch.Tensor, cache: torch.Tensor, interleaved: bool,
      kv_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q_pe), q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_kc.shape[2])


@torch.library.custom_op("encore::mla_attention", mutates_args=("out",))
def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                  cache: torch.Tensor, out: torch.Tensor) -> None:
    """Both branches of the step: q_nope [T, H, dn], q_pe [T, H, dr] -> out [T, H, dv]."""
    ctx = current_step()
    _check_tokens("q_nope", q_nope, ctx.batch.num_tokens)
    ctx.backend.attend(q_nope, q_pe, w_kc, w_vc, cache, out, ctx.batch)


@torch.library.custom_op("encore::mla_prefill", mutates_args=("out",))
def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                cache: torch.Tensor, out: torch.Tensor) -> None:
    """The prefill rows' tokens (the first num_extend_tokens of the step, padding included)."""
    ctx = current_step()
    _check_tokens("q_nope", q_nope, ctx.batch.num_extend_tokens)
    ctx.backend.prefill(q_nope, q_pe, w_kc, w_vc, cache, out, ctx.batch)


@torch.library.custom_op("encore::mla_decode", mutates_args=("out",))
def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
               cache: torch.Tensor, out: torch.Tensor, q_lat: torch.Tensor | None = None) -> None:
    """The decode rows' tokens (the last num_decodes * q_len_per_req of the step). ``q_lat``: their
    latent query q_nope · w_kc where the graph computed it (``rope_absorb``)."""
    ctx = current_step()
    batch = ctx.batch
    _check_tokens("q_nope", q_nope, batch.num_decodes * batch.q_len_per_req)
    ctx.backend.decode(q_nope, q_pe, w_kc, w_vc, cache, out, batch, q_lat=q_lat)


for _op in (mla_attention, mla_prefill):
    _op.register_fake(lambda q_nope, q_pe, w_kc, w_vc, cache, out: None)
mla_decode.register_fake(lambda q_nope, q_pe, w_kc, w_vc, cache, out, q_lat=None: None)


def latent_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                     w_kc: torch.Tensor, w_vc: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Writes [kv_c, k_pe] of every token into the layer's latent ``cache``, then attends: what a
    traced graph contains.

    q_nope [T, H, dn], q_pe [T, H, dr], kv_c [T, R], k_pe [T, dr] (rope applied),
    w_kc [H, dn, R] and w_vc [H, dv, R] (kv_b_proj split per head) -> [T, H, dv].
    """
    torch.ops.encore.write_latent_cache(kv_c, k_pe, cache)
    out = torch.empty(q_nope.shape[0], q_nope.shape[1], w_vc.shape[1], dtype=q_nope.dtype,
                      device=q_nope.device)  # [T, H, dv]
    torch.ops.encore.mla_attention(q_nope, q_pe, w_kc, w_vc, cache, out)
    return out
