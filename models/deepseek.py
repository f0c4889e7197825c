"""DeepSeek-V2 / V3 (and Kimi K2) as plain modules: MLA, MoE, the decoder stack and the MTP layer.

The model declares architecture and parameters; the MLA math lives in the attention backend and
the expert math in ``encore.backends.moe``. Parameter names follow the HF checkpoints, except that
``gate_proj``/``up_proj`` are stored fused as ``gate_up_proj`` and the routed experts as stacked
``experts.w13`` [E, 2I, H] / ``experts.w2`` [E, H, I] (see ``loader.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encore.backends.argmax import argmax_rows
from encore.backends.base import AttentionBackend
from encore.backends.dense import dense, rms_norm
from encore.backends.metadata import ForwardBatch
from encore.backends.mla_ops import latent_attention
from encore.backends.moe import route, routed_experts, with_shared_experts
from encore.backends.rope import RotaryEmbedding
from encore.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None


class RoutedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)

    @property
    def num_fused_shared(self) -> int:
        """Shared experts that ``fuse_shared_experts`` appended to the routed experts' stacks."""
        return self.experts.w13.shape[0] - self.cfg.n_routed_experts

    def fuse_shared_experts(self) -> None:
        """Moves the shared experts into the routed experts' stacks (``moe.with_shared_experts``),
        which every token then takes with weight 1: no shared-expert GEMMs of their own."""
        shared = self.shared_experts
        w13, w2 = with_shared_experts(self.experts.w13.data, self.experts.w2.data, shared.gate_up_proj.weight.data,
                                      shared.down_proj.weight.data, self.cfg.n_shared_experts)
        self.experts.w13 = nn.Parameter(w13, requires_grad=False)
        self.experts.w2 = nn.Parameter(w2, requires_grad=False)
        self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        # Ops: one routing kernel on the GPU, and expert computation whose host-dependent shapes no
        # compiled graph may trace.
        weights, ids = route(x, self.gate.weight, self.gate.e_score_correction_bias, cfg.num_experts_per_tok,
                             cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                             cfg.routed_scaling_factor, self.num_fused_shared)
        out = routed_experts(x, self.experts.w13, self.experts.w2, weights, ids, self.num_fused_shared)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def fuse_shared_experts(model: nn.Module) -> int:
    """``MoE.fuse_shared_experts`` on every MoE layer with shared experts (the MTP layer's too);
    returns how many were fused. One layer at a time, so the copy needs one layer's experts of room."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.shared_experts is not None]
    for layer in layers:
        layer.fuse_shared_experts()
    return len(layers)


class MLAttention(nn.Module):
    """Multi-head latent attention: projections here, attention itself in the backend."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 backend: AttentionBackend | None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        q_out = cfg.num_attention_heads * cfg.qk_head_dim
        self.q_lora = cfg.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.rotary = rotary
        # [num_pages, page_size, R + dr]; no backend: a model built only to count its parameters.
        self.kv_cache = backend.kv_caches[layer_id] if backend is not None else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(x.shape[0], self.num_heads, -1)  # [T, H, dn + dr]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)  # [T, R]
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        # kv_b_proj rows are per head [k_nope (dn) | v (dv)]: W_kc [H, dn, R] and W_vc [H, dv, R] are views.
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        w_kc, w_vc = w_kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        out = latent_attention(q_nope, q_pe, kv_c, k_pe, w_kc, w_vc, self.kv_cache)  # [T, H, dv]
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_id, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_id) else DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    """``aux_layers``: layers whose input (the residual stream entering them; index
    num_hidden_layers is the last layer's output) ``forward`` returns after the normed state."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, backend) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.aux_layers = aux_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux.append(x)
            x = layer(x, positions, batch)
        if len(self.layers) in self.aux_layers:
            aux.append(x)
        # One tensor, so that a compiled or captured graph keeps a single output buffer.
        return torch.cat([self.norm(x), *aux], dim=-1) if aux else self.norm(x)  # [T, (1 + A) * hidden]


def lm_head(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``head`` (no bias) over the rows of ``hidden`` [N, hidden] as ``encore::dense``: on CUDA the Triton
    GEMV where ``dense.runs_gemv`` (a full-size head's at one row only), else ``torch.mm``."""
    return dense(hidden, head.weight)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPLayer(nn.Module):
    """DeepSeek-V3 multi-token prediction ("nextn") layer, checkpoint layer index num_hidden_layers.

    For position i it combines the target's last hidden state h_i (after the final norm, as vLLM,
    SGLang and transformers feed it) with the embedding of token i + 1 and predicts token i + 2:
    eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]) -> decoder layer -> shared_head.norm -> head.
    ``forward`` returns the normed state, which is also what a further draft step feeds back in.
    """

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg, cfg.num_hidden_layers, rotary, backend)
        self.shared_head = SharedHead(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(self.layer(x, positions, batch))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head(self.shared_head.head, hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of ``compute_logits`` [N], taken on the head's own output: the float32 cast is exact
        and keeps the order, so it picks the same token without a cast's launch."""
        return argmax_rows(lm_head(self.shared_head.head, hidden))


class DeepseekForCausalLM(nn.Module):
    """The target model. ``forward`` returns the final-normed hidden state of every token (what the
    MTP layer consumes), [T, hidden]; with ``aux_layers`` (an EAGLE-3 drafter's) it is followed by
    the input of each of those layers, ascending: [T, (1 + len(aux_layers)) * hidden].
    ``compute_logits`` applies the head to the gathered rows' normed state only."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None, with_mtp: bool = False,
                 aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        if list(aux_layers) != sorted(set(aux_layers)) or not all(0 <= i <= cfg.num_hidden_layers for i in aux_layers):
            raise ValueError(f"aux_layers must be distinct, ascending and in [0, {cfg.num_hidden_layers}], "
                             f"got {list(aux_layers)}")
        self.cfg = cfg
        max_positions = max(cfg.max_position_embeddings, cfg.rope.original_max_position_embeddings)
        self.rotary = RotaryEmbedding(cfg.rope, max_positions)
        self.model = DeepseekModel(cfg, self.rotary, backend, aux_layers)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPLayer(cfg, self.rotary, backend) if with_mtp else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head(self.lm_head, hidden[:, :self.cfg.hidden_size]).float()  # [N, V]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of ``compute_logits`` [N], on the head's own output (the float32 cast is exact)."""
        return argmax_rows(lm_head(self.lm_head, hidden[:, :self.cfg.hidden_size]))
