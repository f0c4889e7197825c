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
        return self.decode(self.combine(hidden, next_embeds), position_embeddings)

    def combine(self, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input: eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]). [B, T, H]"""
        return self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))

    def decode(
        self,
        x: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder layer and shared_head.norm over `x` [B, T, H]; `attention_mask` [T, T] bool (True:
        attend) replaces the causal mask."""
        mask = None if attention_mask is None else attention_mask[None, None]  # [1, 1, T, T]
        x = super().forward(x, attention_mask=mask, position_embeddings=position_embeddings)
        return self.shared_head["norm"](x)


def draft_chain_mask(length: int, depth: int, device: torch.device | None = None) -> torch.Tensor:
    """Attention of `depth` chained MTP passes over one sequence of `length` positions, laid out as blocks
    [pass 1 | pass 2 | ... | pass depth], each `length` long. [depth * length, depth * length] bool, True: attend.

    Pass q at position j drafts from base b = j - q + 1, the last position the target verified: it reads
    what a q-deep draft finds in the latent cache there, pass 1's keys at positions <= b (written when the
    target's states arrived) and pass r's key at b + r - 1 for r = 2..q (written by the draft steps before
    it). Pass 1 is plain causal attention. Every position reads its own key; positions j < q - 1 have no base,
    and no valid position's draft reads them."""
    j = torch.arange(length, device=device)[:, None]  # query position
    p = torch.arange(length, device=device)[None, :]  # key position
    rows = []
    for q in range(1, depth + 1):
        base = j - q + 1
        blocks = [p <= base] + [p == base + r - 1 for r in range(2, q + 1)]
        blocks += [torch.zeros(length, length, dtype=torch.bool, device=device)] * (depth - q)
        rows.append(torch.cat(blocks, dim=1))
    return torch.cat(rows, dim=0)


def chained_passes(
    mtp: MTPLayer,
    hidden: torch.Tensor,
    next_embeds: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    depth: int,
) -> list[torch.Tensor]:
    """The normed states of MTP passes 1..depth over a whole sequence at once, as a `depth`-deep draft runs
    them: pass 1 is fed the main model's states, pass m > 1 the state pass m - 1 produced one position
    earlier (its draft's position) and the same token embedding, and each pass attends as
    `draft_chain_mask` says. hidden, next_embeds: [B, T, H]; returns `depth` tensors [B, T, H], where pass m
    at position j drafts t_{j+2} from base j - m + 1 (positions j < m - 1 mean nothing).
    Each pass re-runs the passes before it inside one attention call (depth * (depth + 1) / 2 passes' work)."""
    length = hidden.shape[1]
    mask = draft_chain_mask(length, depth, hidden.device)
    cos, sin = position_embeddings
    inputs: list[torch.Tensor] = []
    states: list[torch.Tensor] = []
    for m in range(1, depth + 1):
        if m > 1:  # position j continues the draft made at position j - 1
            hidden = torch.cat([torch.zeros_like(states[-1][:, :1]), states[-1][:, :-1]], dim=1)
        inputs.append(mtp.combine(hidden, next_embeds))
        n = m * length
        out = mtp.decode(torch.cat(inputs, dim=1), (cos.repeat(1, m, 1), sin.repeat(1, m, 1)), mask[:n, :n])
        states.append(out[:, -length:])
    return states


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
