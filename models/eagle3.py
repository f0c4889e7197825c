"""The EAGLE-3 draft model, as HF checkpoints of architecture ``LlamaForCausalLMEagle3`` ship it.

One Llama decoder layer (the "midlayer") drafts from two inputs per position i: the embedding of
token i + 1 and a hidden state h_i, and predicts token i + 2::

    x   = [input_layernorm(embed(t_{i+1})) ; hidden_norm(h_i)]          # [T, 2H]
    r   = h_i   (hidden_norm(h_i) when norm_before_residual)
    y   = r + o_proj(GQA attention with RoPE of q/k/v_proj(x))
    out = y + mlp(post_attention_layernorm(y))                          # pre-norm, fed back
    logits = lm_head(norm(out))                                         # over the draft vocab

On the first pass h_i is ``fc([a0 ; a1 ; a2])``: three auxiliary hidden states of the target at
position i, each the residual stream entering one target layer (its input, residual included), in
ascending layer order. On later draft steps h_i is the drafter's own pre-norm output ``out`` of the
previous step. Draft ids map to target ids by ``target = draft + d2t[draft]``; ``t2d`` is ignored.

Which target layers: ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's key; the ids name
layers whose *output* is captured, so encore captures the input of id + 1), else a top-level
``eagle_aux_hidden_state_layer_ids`` (vLLM's key; the ids name layers whose *input* is captured),
else (2, L // 2, L - 3) inputs, both engines' default. Capture index L is the last layer's output.

``embed_tokens`` may be absent from the checkpoint: then the target's embedding is shared (vLLM's
rule; SGLang always shares the target's). Attention and the drafter's paged KV cache are the
``attention`` callable the model is built with (``encore.engine.spec.draft_kv_cache``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from encore.backends.argmax import argmax_rows
from encore.backends.metadata import ForwardBatch
from encore.backends.rope import rotate
from encore.models.deepseek import DenseMLP, RMSNorm, lm_head
from encore.models.loader import checkpoint_names, copy_checkpoint

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

# (q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d], batch) -> [T, Hq, d]; writes k and v into the cache.
PagedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """``rope_parameters`` is transformers' normalized form (``rope_type``, ``rope_theta``, scaling
    fields); ``aux_layer_ids`` are target layers whose input is captured (None: the default)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    max_position_embeddings: int
    rope_parameters: dict
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab_size}")
        if self.aux_layer_ids is not None and len(set(self.aux_layer_ids)) != 3:
            raise ValueError(f"EAGLE-3 needs 3 distinct auxiliary layer ids, got {list(self.aux_layer_ids)}")

    @property
    def kv_elems_per_token(self) -> int:
        """Elements one token occupies in the drafter's KV cache (K and V)."""
        return 2 * self.num_key_value_heads * self.head_dim

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose input is captured, ascending (index L: the last layer's output)."""
        n = num_target_layers
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else (2, n // 2, n - 3)
        if len(set(ids)) != 3 or not all(0 <= i <= n for i in ids):
            raise ValueError(f"EAGLE-3 auxiliary layers {list(ids)} do not fit a target of {n} layers "
                             f"(3 distinct capture indices in [0, {n}] are needed)")
        return tuple(sorted(ids))

    @staticmethod
    def from_pretrained(model_dir: str | Path) -> Eagle3Config:
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"draft_model {str(model_dir)!r} is not a directory; pass the EAGLE-3 "
                             "checkpoint's directory")
        if not (path / "config.json").is_file():
            raise ValueError(f"draft_model {str(model_dir)!r} has no config.json")
        return Eagle3Config.from_dict(json.loads((path / "config.json").read_text()))

    @staticmethod
    def from_dict(raw: dict) -> Eagle3Config:
        """Normalizes config.json through transformers' LlamaConfig (rope_theta / rope_scaling)."""
        from transformers import LlamaConfig

        archs = raw.get("architectures") or []
        if not archs or archs[0] not in ARCHITECTURES:
            raise ValueError(f"draft model architecture {archs!r} is not an EAGLE-3 drafter; "
                             f"expected one of {ARCHITECTURES}")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE-3 drafters with num_hidden_layers={raw['num_hidden_layers']} are not "
                             "supported; encore runs the single midlayer")
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ValueError("eagle_config.use_aux_hidden_state=False is not supported: encore's EAGLE-3 "
                             "drafter consumes the target's three auxiliary hidden states")
        sglang_ids = eagle.get("eagle_aux_hidden_state_layer_ids")  # layers whose output is captured
        vllm_ids = raw.get("eagle_aux_hidden_state_layer_ids")  # layers whose input is captured
        aux = tuple(i + 1 for i in sglang_ids) if sglang_ids else tuple(vllm_ids) if vllm_ids else None
        hf = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")})
        if hf.hidden_act != "silu":
            raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported; EAGLE-3 midlayers use 'silu'")
        return Eagle3Config(
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            rms_norm_eps=hf.rms_norm_eps,
            vocab_size=hf.vocab_size,
            draft_vocab_size=raw.get("draft_vocab_size") or hf.vocab_size,
            target_hidden_size=raw.get("target_hidden_size") or hf.hidden_size,
            max_position_embeddings=hf.max_position_embeddings,
            rope_parameters=dict(hf.rope_parameters),
            aux_layer_ids=aux,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )


def rope_inverse_frequencies(cfg: Eagle3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention scaling of cos/sin), by transformers' rope functions."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = cfg.rope_parameters.get("rope_type", "default")
    if kind == "default":
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        return 1.0 / (cfg.rope_parameters["rope_theta"] ** exponents), 1.0
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {kind!r} is not supported; expected 'default' or one of "
                         f"{list(ROPE_INIT_FUNCTIONS)}")
    hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                     max_position_embeddings=cfg.max_position_embeddings, rope_parameters=dict(cfg.rope_parameters))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    return inv_freq.float(), float(scaling)


class LlamaRotary(nn.Module):
    """Llama's (non-interleaved) RoPE over the whole head; angles computed per step from inv_freq,
    as transformers does, so positions past the drafter's own max_position_embeddings just work."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.scaling = 1.0
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        if not self.inv_freq.is_meta:
            self.init_buffers()

    def init_buffers(self) -> None:
        """Fills inv_freq; the loader calls it after materializing a meta-built model."""
        inv_freq, self.scaling = rope_inverse_frequencies(self.cfg)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[:, None].float() * self.inv_freq[None, :]  # [T, d / 2]
        cos, sin = angles.cos() * self.scaling, angles.sin() * self.scaling
        return rotate(q, cos[:, None], sin[:, None], False), rotate(k, cos[:, None], sin[:, None], False)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, attention: PagedAttention) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.rotary = LlamaRotary(cfg)
        self.attention = attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, -1, self.head_dim)  # [T, Hq, d]
        k = self.k_proj(x).view(tokens, -1, self.head_dim)  # [T, Hkv, d]
        v = self.v_proj(x).view(tokens, -1, self.head_dim)  # [T, Hkv, d]
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attention(q, k, v, batch).flatten(1))


class Eagle3Layer(nn.Module):
    """The midlayer: attention over [embedding ; hidden] (2H wide), then a SwiGLU MLP."""

    def __init__(self, cfg: Eagle3Config, attention: PagedAttention) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, attention)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        x = residual + self.self_attn(x, positions, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Model(nn.Module):
    """``forward`` returns the pre-norm output (what the next draft step feeds back);
    ``compute_logits`` gives logits over the *target* vocab, -inf off the draft vocab."""

    def __init__(self, cfg: Eagle3Config, attention: PagedAttention, own_embedding: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg, attention)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # A frozen parameter, so that the loader fills it like any other checkpoint tensor.
        self.d2t = nn.Parameter(torch.zeros(cfg.draft_vocab_size, dtype=torch.long), requires_grad=False)
        # The target id of each draft id (d2t + arange), set by the loader once d2t is checked.
        self.register_buffer("target_ids", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=False)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary states [T, 3·H_target] -> the first pass's hidden input [T, H]."""
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        return self.midlayer(self.embed_tokens(input_ids), hidden, positions, batch)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = lm_head(self.lm_head, self.norm(hidden)).float()  # [N, Vd]
        logits = draft.new_full((draft.shape[0], self.cfg.vocab_size), float("-inf"))  # [N, V]
        return logits.index_copy_(1, self.target_ids, draft)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """A greedy draft [N] in target ids: the draft vocab's argmax, mapped (no target-vocab logits built).
        Where draft ids tie it takes the lowest draft id, which ``compute_logits``' argmax may order
        differently when d2t does not keep the order: either is a greedy draft."""
        return self.target_ids[argmax_rows(lm_head(self.lm_head, self.norm(hidden)))]


def load_eagle3(model_dir: str | Path, cfg: Eagle3Config, attention: PagedAttention,
                target_embedding: nn.Embedding, device: torch.device, dtype: torch.dtype) -> Eagle3Model:
    """Builds the drafter on the meta device and fills it from ``model_dir`` (see loader.py).
    Checkpoint names may carry a ``model.`` prefix; ``d2t`` may be absent only when the draft vocab
    is the target's; without ``embed_tokens`` the drafter uses ``target_embedding``."""
    path = Path(model_dir)
    own_embedding = any(_param_name(n) == "embed_tokens.weight" for n in checkpoint_names(path))
    with torch.device("meta"):
        model = Eagle3Model(cfg, attention, own_embedding)
    model = model.to(dtype).to_empty(device=device)
    model.midlayer.self_attn.rotary.init_buffers()
    missing = copy_checkpoint(path, dict(model.named_parameters()), lambda name: _eagle3_target(name, cfg))
    if "d2t" in missing and cfg.draft_vocab_size == cfg.vocab_size:
        model.d2t.zero_()
        missing.remove("d2t")
    if missing:
        raise ValueError(f"tensors missing from draft checkpoint {str(model_dir)!r}: {missing[:20]}")
    target_ids = model.d2t + torch.arange(cfg.draft_vocab_size, device=device)
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= cfg.vocab_size:
        raise ValueError(f"d2t in {str(model_dir)!r} maps draft ids to target ids in [{int(target_ids.min())}, "
                         f"{int(target_ids.max())}], outside the vocabulary [0, {cfg.vocab_size})")
    model.target_ids = target_ids
    if not own_embedding:
        if tuple(target_embedding.weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"draft checkpoint {str(model_dir)!r} has no embed_tokens and the target's embedding "
                             f"{tuple(target_embedding.weight.shape)} cannot stand in for "
                             f"({cfg.vocab_size}, {cfg.hidden_size})")
        model.embed_tokens = target_embedding
    return model.eval()


def _param_name(ckpt_name: str) -> str:
    return ckpt_name.removeprefix("model.")


def _eagle3_target(ckpt_name: str, cfg: Eagle3Config) -> tuple[str, object] | None:
    """Checkpoint name -> (parameter name, index into it or None); None skips it."""
    name = _param_name(ckpt_name)
    if name == "t2d":
        return None  # which target ids the draft vocab holds: a training artifact, d2t says it all
    half = cfg.intermediate_size
    if name == "midlayer.mlp.gate_proj.weight":
        return "midlayer.mlp.gate_up_proj.weight", slice(0, half)
    if name == "midlayer.mlp.up_proj.weight":
        return "midlayer.mlp.gate_up_proj.weight", slice(half, 2 * half)
    return name, None
