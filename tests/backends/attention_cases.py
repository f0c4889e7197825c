"""Random attention steps (prefill rows with prefixes, decode rows, bucket padding, shuffled pages) and
the check every fast backend passes against the torch reference. Imports no triton: the Triton tests
set TRITON_INTERPRET before triton is first imported."""

from __future__ import annotations

import torch

from encore.backends.base import MLADims
from encore.backends.context import StepContext
from encore.backends.metadata import ForwardBatch
from encore.backends.mla_ops import latent_attention
from encore.backends.torch_backend import TorchAttentionBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_DIMS = MLADims(num_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kv_lora_rank=64,
                     softmax_scale=48 ** -0.5)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PADDING = 3  # bucket-padding tokens after the prefill rows' tokens, owned by no row


def make_step(extends: list[tuple[int, int]], decodes: list[int], q_len: int, page_size: int,
              dtype: torch.dtype, dims: MLADims = SMALL_DIMS, seed: int = 0):
    """A step of prefill rows (prefix_len, new_tokens), then decode rows (seq_len, q_len tokens each),
    over a random latent cache with shuffled pages (page 0: the dummy page padding writes to), and
    random q / latents / weights. Returns (batch, cache, inputs)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in extends] + decodes
    prefix = [p for p, _ in extends] + [s - q_len for s in decodes]
    max_pages = max(-(-s // page_size) for s in lens) + 1  # a spare column, left 0
    needed = sum(-(-s // page_size) for s in lens)
    pages = (torch.randperm(needed, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens), max_pages, dtype=torch.int32)
    for b, s in enumerate(lens):
        for j in range(-(-s // page_size)):
            table[b, j] = pages.pop()
    positions, slots = [], []
    qo = [0]
    for b, (p, s) in enumerate(zip(prefix, lens)):
        pad = PADDING if b == len(extends) and extends else 0
        # bucket padding after the prefill tokens (as graphs/padding.py lays it out): position 0, the
        # dummy page, outside qo_indptr[E]; the decode rows' offsets count it
        positions += [0] * pad
        slots += [0] * pad
        for pos in range(p, s):
            positions.append(pos)
            slots.append(int(table[b, pos // page_size]) * page_size + pos % page_size)
        qo.append(qo[-1] + pad + s - p)
    if not decodes:
        positions += [0] * PADDING
        slots += [0] * PADDING
    tokens = len(positions)
    to = dict(device=DEVICE)
    batch = ForwardBatch(
        num_extends=len(extends), q_len_per_req=q_len, bs=len(lens), num_tokens=tokens, page_size=page_size,
        input_ids=torch.zeros(tokens, dtype=torch.int64, **to), positions=torch.tensor(positions, **to),
        slot_mapping=torch.tensor(slots, **to), seq_lens=torch.tensor(lens, dtype=torch.int32, **to),
        prefix_lens=torch.tensor(prefix, dtype=torch.int32, **to), qo_indptr=torch.tensor(qo, dtype=torch.int32, **to),
        page_table=table.to(DEVICE), gather_ids=torch.arange(tokens, **to), seq_lens_cpu=lens, prefix_lens_cpu=prefix)
    d = dims
    cache = torch.randn(needed + 1, page_size, d.latent_dim, generator=gen).to(DEVICE, dtype)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    inputs = (rand(tokens, d.num_heads, d.qk_nope_head_dim), rand(tokens, d.num_heads, d.qk_rope_head_dim),
              rand(tokens, d.kv_lora_rank), rand(tokens, d.qk_rope_head_dim),
              rand(d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank, scale=d.kv_lora_rank ** -0.5),
              rand(d.num_heads, d.v_head_dim, d.kv_lora_rank, scale=d.kv_lora_rank ** -0.5))
    return batch, cache, inputs


def run_backend(cls, batch: ForwardBatch, cache: torch.Tensor, inputs, dims: MLADims = SMALL_DIMS,
                static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    caches = [cache.clone()]
    backend = cls(caches, dims)
    backend.plan(batch, static)
    with StepContext(backend).bind(batch):
        out = latent_attention(*inputs, caches[0])
    return out, caches[0]


def real_tokens(batch: ForwardBatch) -> torch.Tensor:
    """Token indices that belong to a row (bucket padding excluded)."""
    keep = torch.ones(batch.num_tokens, dtype=torch.bool)
    end = batch.qo_indptr[batch.num_extends].item() if batch.num_extends else 0
    keep[end:batch.num_extend_tokens] = False
    return keep.nonzero().flatten().to(DEVICE)


def max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref.float()).flatten(1).norm(dim=1)
    return (diff / ref.float().flatten(1).norm(dim=1).clamp_min(1.0)).max().item()


def check_against_torch(cls, extends, decodes, q_len, page_size, dtype, dims: MLADims = SMALL_DIMS,
                        static: bool = False):
    """``cls`` against the torch reference on one step: the same cache writes, finite outputs (bucket
    padding included), the real tokens' outputs within TOL. Returns the step's batch."""
    batch, cache, inputs = make_step(extends, decodes, q_len, page_size, dtype, dims)
    got, got_cache = run_backend(cls, batch, cache, inputs, dims, static)
    want, want_cache = run_backend(TorchAttentionBackend, batch, cache, inputs, dims)
    assert torch.equal(got_cache[1:], want_cache[1:])  # page 0: padding writes, in no fixed order
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()  # bucket padding included
    keep = real_tokens(batch)
    assert max_rel_error(got[keep], want[keep]) < TOL[dtype]
    return batch


LAYOUTS = {
    "decode-q1": ([], [1, 5, 40, 77], 1),
    "decode-q3": ([], [3, 9, 40, 70], 3),
    "prefill": ([(0, 7), (0, 1), (0, 33)], [], 1),
    "prefill-prefix": ([(5, 7), (0, 4), (30, 20)], [], 1),
    "mixed": ([(3, 9), (0, 5)], [1, 17, 50], 1),
    "mixed-q3": ([(20, 6)], [3, 33], 3),
}
