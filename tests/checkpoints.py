"""Tiny random DeepSeek checkpoints written by transformers' own model classes (the references)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512,
               initializer_range=0.1, bos_token_id=0, eos_token_id=1)

KINDS = {
    # DeepSeek-V2-Lite style: no q_lora, softmax routing, plain top-k, one dense layer first.
    "v2_lite": ("v2", dict(q_lora_rank=None, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                           first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0)),
    # DeepSeek-V2 style: q_lora, group-limited greedy routing with scaling.
    "v2": ("v2", dict(q_lora_rank=48, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
                      first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                      routed_scaling_factor=1.5)),
    # DeepSeek-V3 style: q_lora, YaRN with mscale, sigmoid + bias group routing, normalized top-k.
    "v3": ("v3", dict(q_lora_rank=48, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                      first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                      norm_topk_prob=True,
                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                       "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                       "rope_theta": 10000.0})),
}

TOKENIZER_TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
                  "The quick brown fox jumps over the lazy dog. Ünïcödé — 日本語 text, emoji 🙂.\n") * 20


def write_checkpoint(kind: str, path: Path, seed: int = 0, overrides: dict | None = None) -> Path:
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)

    family, extra = KINDS[kind]
    fields = {**_COMMON, **extra, **(overrides or {})}
    torch.manual_seed(seed)
    if family == "v2":
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**fields))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**fields))
        with torch.no_grad():  # HF initializes the correction bias to zero: make it matter
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn_like(buf) * 0.1)
    model.save_pretrained(path)
    if fields["vocab_size"] >= VOCAB:
        write_tokenizer(path)
    return path


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>").save_pretrained(path)


def write_mtp_checkpoint(path: Path, vocab: int = VOCAB, seed: int = 0) -> Path:
    """A V3-style checkpoint with an MTP (nextn) layer under DeepSeek-V3's tensor names.

    transformers writes no MTP layer, so one more decoder layer is saved and renamed into the
    nextn layer, and its own tensors (enorm, hnorm, eh_proj, embedding, shared head) are added.
    """
    import json

    from safetensors.torch import load_file, save_file

    layers = _COMMON["num_hidden_layers"]
    write_checkpoint("v3", path, seed, overrides={"num_hidden_layers": layers + 1, "vocab_size": vocab})
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = _COMMON["hidden_size"]
    mtp = f"model.layers.{layers}."
    tensors[mtp + "enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    tensors[mtp + "hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    tensors[mtp + "eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


EAGLE3_SHAPE = dict(hidden_size=_COMMON["hidden_size"], intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)


def eagle3_config(vocab: int, draft_vocab: int) -> dict:
    """config.json of a tiny LlamaForCausalLMEagle3 drafter for the tiny targets (GQA 4 / 2 heads,
    llama3 rope scaling that changes the low frequencies within a few dozen positions)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **EAGLE3_SHAPE,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "hidden_act": "silu", "vocab_size": vocab,
            "draft_vocab_size": draft_vocab, "max_position_embeddings": 512, "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}


def write_eagle3_checkpoint(path: Path, vocab: int = VOCAB, draft_vocab: int = 200, seed: int = 0,
                            target_ids: list[int] | None = None, with_embedding: bool = False) -> Path:
    """A random EAGLE-3 drafter under the tensor names HF checkpoints use (``midlayer.*``, ``fc``,
    ``norm``, ``lm_head``, ``d2t``, ``t2d``); draft id i stands for target id ``target_ids[i]``
    (a seeded random ascending subset of the target vocab unless given), so d2t is non-trivial.
    Without ``with_embedding`` the drafter shares the target's embedding."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = EAGLE3_SHAPE["hidden_size"], EAGLE3_SHAPE["intermediate_size"]
    q_out = EAGLE3_SHAPE["num_attention_heads"] * EAGLE3_SHAPE["head_dim"]
    kv_out = EAGLE3_SHAPE["num_key_value_heads"] * EAGLE3_SHAPE["head_dim"]
    if target_ids is None:
        target_ids = sorted(torch.randperm(vocab, generator=gen)[:draft_vocab].tolist())
    ids = torch.tensor(target_ids, dtype=torch.long)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=gen)

    tensors = {
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": weight(q_out, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": weight(kv_out, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": weight(kv_out, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": weight(hidden, q_out),
        "midlayer.mlp.gate_proj.weight": weight(inter, hidden), "midlayer.mlp.up_proj.weight": weight(inter, hidden),
        "midlayer.mlp.down_proj.weight": weight(hidden, inter),
        "norm.weight": norm(), "fc.weight": weight(hidden, 3 * hidden), "lm_head.weight": weight(len(ids), hidden),
        "d2t": ids - torch.arange(len(ids)), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True),
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(eagle3_config(vocab, len(ids)), indent=2))
    return path
