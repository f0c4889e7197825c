"""Checkpoint loading: sharded checkpoints, and errors that name unknown or missing tensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from encore.engine import Engine, SamplingParams
from encore.models.deepseek import DeepseekForCausalLM

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_sharded_checkpoint_loads_and_matches_the_single_file(v3_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(v3_dir, dtype=torch.float32).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    want = Engine(str(v3_dir), device="cpu").generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert Engine(str(sharded), device="cpu").generate([[5, 6, 7]], GREEDY)[0].token_ids == want


def copy_with(v3_dir, tmp_path, edit) -> str:
    path = tmp_path / "edited"
    shutil.copytree(v3_dir, path)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def test_unknown_tensors_are_named(v3_dir, tmp_path):
    path = copy_with(v3_dir, tmp_path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unknown tensors .*model\.layers\.0\.self_attn\.extra\.weight"):
        Engine(path, device="cpu")


def test_missing_tensors_are_named(v3_dir, tmp_path):
    path = copy_with(v3_dir, tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"tensors missing .*model\.layers\.1\.mlp\.experts\.w13"):
        Engine(path, device="cpu")


def test_wrong_shapes_are_named(v3_dir, tmp_path):
    path = copy_with(v3_dir, tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(3,\)"):
        Engine(path, device="cpu")


def test_a_model_built_without_a_backend_has_the_loaded_models_parameters(v3_dir):
    """How the KV pool is sized on CUDA: the model built on the meta device, with no backend or cache."""
    engine = Engine(str(v3_dir), device="cpu")
    with torch.device("meta"):
        bare = DeepseekForCausalLM(engine.model_config, None)
    assert sum(p.numel() for p in bare.parameters()) == sum(p.numel() for p in engine.runner.model.parameters())
