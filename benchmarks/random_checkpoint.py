"""Writes a checkpoint of random weights at DeepSeek-V2-Lite's widths, for the benchmarks that load a model
directory (``bench_server.py --model``): a model whose decode step is bound by the GPU, where encore-tiny's
is bound by the host.

The layout is encore-tiny's (DeepSeek-V3's architecture: sigmoid routing with a score bias, experts split
per expert in the checkpoint), at V2-Lite's widths: hidden 2048, 16 heads, no query LoRA, latent 512 + 64,
64 routed experts of 1408 (6 a token) plus 2 shared, a dense first layer of 10944; ``--layers`` layers
(V2-Lite has 27) and encore-tiny's tokenizer and vocabulary (8192), so text prompts work. No MTP layer.
Weights N(0, 0.02) in bf16 from a seeded generator, norms 1, router biases 0 (float32), one shard a layer.

    python benchmarks/random_checkpoint.py OUT_DIR [--layers 6] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from encore.models.tiny import default_model_dir
from encore.models.tiny.checkpoint import split_experts

V2_LITE_WIDTHS = dict(
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, qk_head_dim=192, head_dim=64, v_head_dim=128,
    moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1,
    n_shared_experts=2, first_k_dense_replace=1, intermediate_size=10944, num_nextn_predict_layers=0)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def config(layers: int) -> dict:
    """encore-tiny's config.json with V2-Lite's widths and ``layers`` layers."""
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    cfg.update(V2_LITE_WIDTHS, num_hidden_layers=layers)
    return cfg


def random_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """On the host, drawn on ``gen``'s device."""
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen, device=gen.device) * 0.02).to(torch.bfloat16).cpu()


def write(out: Path, layers: int, seed: int = 0, device: str = "cpu") -> None:
    """``device``: where the weights are drawn ("cuda" takes seconds for V2-Lite's 27 layers, where one
    CPU thread takes minutes); a seed gives other weights on another device."""
    cfg = config(layers)
    hf_config = DeepseekV3Config(**{k: v for k, v in cfg.items()
                                    if k not in ("architectures", "transformers_version", "torch_dtype", "dtype")})
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in DeepseekV3ForCausalLM(hf_config).state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            shards.setdefault("other.safetensors", {})[name] = random_tensor(name, shape, gen)
            continue
        prefix, local = ".".join(parts[:3]) + ".", ".".join(parts[3:])
        tensors = split_experts(local, random_tensor(name, shape, gen))
        shards.setdefault(f"layer-{int(parts[2]):03d}.safetensors", {}).update(
            {prefix + k: v.contiguous() for k, v in tensors.items()})
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, out / shard)
        weight_map.update(dict.fromkeys(tensors, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in _TOKENIZER_FILES:
        shutil.copy(default_model_dir() / name, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: much faster)")
    args = ap.parse_args()
    write(args.out, args.layers, args.seed, args.device)


if __name__ == "__main__":
    main()
