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


def write_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)

    family, extra = KINDS[kind]
    torch.manual_seed(seed)
    if family == "v2":
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**_COMMON, **extra))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**_COMMON, **extra))
        with torch.no_grad():  # HF initializes the correction bias to zero: make it matter
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn_like(buf) * 0.1)
    model.save_pretrained(path)
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
