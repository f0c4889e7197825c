"""ModelConfig: the architecture facts encore needs, read from a checkpoint's config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK2ForCausalLM")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of the rope part of q/k (``qk_rope_head_dim`` wide).

    ``kind`` is "default" or "yarn"; the YaRN fields follow DeepSeek's config.json.
    """

    kind: str
    theta: float
    dim: int
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    interleaved: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("default", "yarn"):
            raise ValueError(f"rope_type {self.kind!r} is not supported; expected 'default' or 'yarn'")
        if self.kind == "yarn" and self.original_max_position_embeddings <= 0:
            raise ValueError("yarn rope needs original_max_position_embeddings > 0")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention_bias: bool
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; expected one of {_ARCHITECTURES}")
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; expected softmax or sigmoid")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"topk_method {self.topk_method!r} is not supported")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent-cache entry: the compressed kv plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (bool(self.n_routed_experts) and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @staticmethod
    def from_pretrained(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}")
        return ModelConfig.from_dict(json.loads(path.read_text()))

    @staticmethod
    def from_dict(raw: dict) -> ModelConfig:
        """Normalizes a config.json through transformers' own config class for its model_type."""
        from transformers import AutoConfig

        archs = raw.get("architectures") or []
        arch = archs[0] if archs else {"deepseek_v2": "DeepseekV2ForCausalLM"}.get(
            raw.get("model_type"), "DeepseekV3ForCausalLM")
        model_type = raw.get("model_type", "deepseek_v3")
        if model_type == "kimi_k2":
            model_type = "deepseek_v3"
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "auto_map")}
        hf = AutoConfig.for_model(model_type, **fields)
        is_v3 = arch != "DeepseekV2ForCausalLM"
        rope_params = dict(hf.rope_parameters or {})
        rope_kind = rope_params.get("rope_type", "default")
        rope = RopeConfig(
            kind=rope_kind,
            theta=float(rope_params.get("rope_theta", 10000.0)),
            dim=hf.qk_rope_head_dim,
            factor=float(rope_params.get("factor") or 1.0),
            original_max_position_embeddings=int(rope_params.get("original_max_position_embeddings") or 0),
            beta_fast=float(rope_params.get("beta_fast") or 32.0),
            beta_slow=float(rope_params.get("beta_slow") or 1.0),
            mscale=float(rope_params.get("mscale") or 1.0),
            mscale_all_dim=float(rope_params.get("mscale_all_dim") or 0.0),
            interleaved=bool(getattr(hf, "rope_interleave", True)),
        )
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        n_group = getattr(hf, "n_group", None) or 1
        return ModelConfig(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            moe_intermediate_size=hf.moe_intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            q_lora_rank=hf.q_lora_rank,
            kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim,
            n_routed_experts=hf.n_routed_experts,
            n_shared_experts=hf.n_shared_experts or 0,
            num_experts_per_tok=hf.num_experts_per_tok or 0,
            first_k_dense_replace=hf.first_k_dense_replace or 0,
            moe_layer_freq=raw.get("moe_layer_freq", 1),
            scoring_func=raw.get("scoring_func", "sigmoid" if is_v3 else "softmax"),
            topk_method=raw.get("topk_method", "noaux_tc" if is_v3 else hf.topk_method or "greedy"),
            n_group=n_group,
            topk_group=getattr(hf, "topk_group", None) or n_group,
            norm_topk_prob=bool(hf.norm_topk_prob),
            routed_scaling_factor=float(hf.routed_scaling_factor),
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            rope=rope,
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos_ids,
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0
