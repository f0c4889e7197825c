"""Weight layout for the pre-attention GEMM fusion.

The fusion pass (passes/fuse_qkv_a_proj.py) turns the q (or q_a) projection and kv_a_proj_with_mqa
into one GEMM over one weight. Concatenating the two weights inside the graph would re-read (and
copy) both every step; instead their storage is laid out once, here, as one [Nq + R + dr, hidden]
block, with each Linear's weight a view of its rows. The modules and the state dict are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from encore.models.deepseek import MLAttention
from encore.passes.fx_utils import adjacent_rows


def query_projection(attn: MLAttention) -> nn.Linear:
    return attn.q_a_proj if attn.q_lora else attn.q_proj


@torch.no_grad()
def colocate_pre_attention_weights(model: nn.Module) -> int:
    """Lays out each attention layer's query and kv_a weights as one block; returns how many layers
    it changed (0 on a second call)."""
    changed = 0
    for attn in (m for m in model.modules() if isinstance(m, MLAttention)):
        q_lin, kv_lin = query_projection(attn), attn.kv_a_proj_with_mqa
        if adjacent_rows(q_lin.weight, kv_lin.weight):
            continue
        fused = torch.cat([q_lin.weight, kv_lin.weight])  # [Nq + R + dr, hidden]
        rows = q_lin.weight.shape[0]
        q_lin.weight = nn.Parameter(fused[:rows], requires_grad=False)
        kv_lin.weight = nn.Parameter(fused[rows:], requires_grad=False)
        changed += 1
    return changed
