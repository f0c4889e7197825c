"""DeepSeek-V3 multi-token prediction (MTP, "nextn") for training, built from transformers' own layers.

Convention, as the serving engines apply real DeepSeek-V3 MTP weights (vLLM `deepseek_mtp.py`
`DeepSeekMultiTokenPredictorLayer.forward`, SGLang `deepseek_nextn.py` `DeepseekModelNextN.forward`,
transformers 5.23 `modeling_layers.MtpLayer`, which tests/models/test_tiny_train.py checks this against):

    h_i      the main model's hidden state at position i AFTER its final norm (`model.norm`), i.e. exactly
             what `lm_head` sees: vLLM's and SGLang's `DeepseekV2Model.forward` return `norm(h + residual)`
             and that tensor is what they hand the drafter; transformers passes `hidden_states[-1]`, which
             it ties to `last_hidden_state`.
    x_i      = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))     embedding first, hidden second
    x_i      = DecoderLayer_L(x_i)          a full MLA + MoE layer, index L = num_hidden_layers
    logits_i = shared_head.head(shared_head.norm(x_i))                predicts t_{i+2}

The embedding and output head are shared with the main model while training (DeepSeek-V3 §2.2); the
checkpoint still stores copies under the MTP layer's prefix, as DeepSeek-V3's does (see checkpoint.py).
vLLM additionally zeroes the embedding of the position-0 row at inference; SGLang and transformers do not,
and training here does not either.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm


class MTPLayer(DeepseekV3DecoderLayer):
    """A decoder layer plus the MTP-only tensors, so that its state-dict names are the checkpoint's names
    under `model.layers.{L}.` (`self_attn.*`, `mlp.*`, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`)."""

    def __init__(self, config: DeepseekV3Config) -> None:
        if config._attn_implementation != "sdpa":
            # forward() passes no mask and relies on SDPA's is_causal; eager attention would read None as "no mask".
            raise ValueError(f"MTPLayer needs attn_implementation 'sdpa', got {config._attn_implementation!r}")
        super().__init__(config, layer_idx=config.num_hidden_layers)
        hidden = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = nn.ModuleDict({"norm": DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)})

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """hidden: main model's final-normed states [B, T, H]; next_embeds: embed(t_{i+1}) [B, T, H].
        Returns the normed MTP states [B, T, H]; the shared head turns them into logits for t_{i+2}."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))  # [B, T, H]
        x = super().forward(x, attention_mask=None, position_embeddings=position_embeddings)
        return self.shared_head["norm"](x)


class DeepseekV3WithMTP(nn.Module):
    """transformers' `DeepseekV3ForCausalLM` (`.main`) and one MTP layer (`.mtp`), trained together."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.main = DeepseekV3ForCausalLM(config)
        self.mtp = MTPLayer(self.main.config)
        # Initialize exactly as transformers initializes the main model's layers (experts start uninitialized).
        self.mtp.apply(self.main._init_weights)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens: [B, T + 2]. Positions 0..T-1 are inputs; the main model predicts t_{i+1}, MTP t_{i+2}.
        Returns (main logits [B, T, V], MTP logits [B, T, V], main loss, MTP loss)."""
        inputs, next_tokens = tokens[:, :-2], tokens[:, 1:-1]  # [B, T]
        hidden = self.main.model(input_ids=inputs, use_cache=False).last_hidden_state  # [B, T, H], final-normed
        logits = self.main.lm_head(hidden)  # [B, T, V]
        position_ids = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0)  # [1, T]
        position_embeddings = self.main.model.rotary_emb(hidden, position_ids)
        next_embeds = self.main.model.embed_tokens(next_tokens)  # [B, T, H]
        mtp_logits = self.main.lm_head(self.mtp(hidden, next_embeds, position_embeddings))  # [B, T, V]
        main_loss = F.cross_entropy(logits.flatten(0, 1).float(), next_tokens.flatten())
        mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1).float(), tokens[:, 2:].flatten())
        return logits, mtp_logits, main_loss, mtp_loss

    def parameter_count(self) -> int:
        """Distinct trainable parameters (the MTP layer's embedding and head are the main model's)."""
        return sum(p.numel() for p in self.parameters())
