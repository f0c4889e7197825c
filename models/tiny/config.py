"""Dimensions of encore-tiny, and their translation into transformers' `DeepseekV3Config`.

The defaults are the shipped checkpoint. They are sized so that the bf16 checkpoint, *with* the MTP layer's
own copies of the embedding and output head (as real DeepSeek-V3 checkpoints store them) and the tokenizer,
stays under 20 MB: the four vocab x hidden matrices are 6.3M of the ~9M stored parameters, so hidden stays
at 192 and the layers are kept small.
"""

from dataclasses import asdict, dataclass

from transformers import DeepseekV3Config


@dataclass(frozen=True, slots=True)
class TinyModelConfig:
    """Architecture of encore-tiny: every DeepSeek-V3 feature, at toy size."""

    vocab_size: int = 8192
    hidden_size: int = 192
    num_hidden_layers: int = 4  # layer 0 dense, layers 1..3 MoE; the MTP layer is layer 4
    first_k_dense_replace: int = 1
    intermediate_size: int = 512  # the dense layer's MLP
    # MLA: the latent KV cache row is kv_lora_rank + qk_rope_head_dim = 160 wide (576 in DeepSeek-V3).
    num_attention_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    # MoE: sigmoid scores + e_score_correction_bias, group-limited top-k, one shared expert.
    n_routed_experts: int = 16
    n_group: int = 4
    topk_group: int = 2
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 32
    routed_scaling_factor: float = 2.5
    # YaRN, as DeepSeek-V3 ships it (factor 40 over 4096 there): train at the original length, serve 4x longer.
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 1.0
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.n_routed_experts} must be a multiple of n_group={self.n_group}")
        if self.n_routed_experts // self.n_group < 2:
            # The router scores a group by the sum of its two best experts.
            raise ValueError(f"each of the n_group={self.n_group} groups needs at least 2 experts")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        candidates = self.topk_group * self.n_routed_experts // self.n_group
        if not 0 < self.num_experts_per_tok <= candidates:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {candidates}]")
        if not 0 <= self.first_k_dense_replace < self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace={self.first_k_dense_replace} must leave at least one MoE layer "
                f"among num_hidden_layers={self.num_hidden_layers}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.max_position_embeddings <= self.original_max_position_embeddings:
            raise ValueError("max_position_embeddings must exceed original_max_position_embeddings for YaRN")
        if self.num_nextn_predict_layers != 1:
            raise ValueError(f"num_nextn_predict_layers={self.num_nextn_predict_layers}: only 1 is supported")

    @property
    def yarn_factor(self) -> float:
        return self.max_position_embeddings / self.original_max_position_embeddings

    def to_hf(self, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> DeepseekV3Config:
        """The transformers config; token ids come from the tokenizer trained alongside."""
        return DeepseekV3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            first_k_dense_replace=self.first_k_dense_replace,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            n_routed_experts=self.n_routed_experts,
            n_group=self.n_group,
            topk_group=self.topk_group,
            num_experts_per_tok=self.num_experts_per_tok,
            n_shared_experts=self.n_shared_experts,
            routed_scaling_factor=self.routed_scaling_factor,
            norm_topk_prob=True,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rope_interleave=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": self.rope_theta,
                "factor": self.yarn_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.yarn_beta_fast,
                "beta_slow": self.yarn_beta_slow,
                "mscale": self.yarn_mscale,
                "mscale_all_dim": self.yarn_mscale_all_dim,
            },
            num_nextn_predict_layers=self.num_nextn_predict_layers,
            rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.initializer_range,
            tie_word_embeddings=False,
            attention_bias=False,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )

    def summary(self) -> dict[str, float | int]:
        return asdict(self)
