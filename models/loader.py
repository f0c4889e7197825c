"""Loading HF safetensors checkpoints (single file or sharded) into encore's DeepSeek modules.

The model is built on the meta device, materialized once in the target dtype and device, and each
checkpoint tensor is read straight into its parameter (or its slice of a fused / stacked one;
``weight_stream``), so no second copy of the weights ever exists. Unknown, misshapen or missing
tensors are errors that name them (the first two before anything is read).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from encore.backends.base import AttentionBackend
from encore.models.config import ModelConfig
from encore.models.deepseek import DeepseekForCausalLM
from encore.models.shards import checkpoint_files
from encore.models.weight_stream import StoredTensor, read_into, stored_tensors

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(mlp|mlp\.shared_experts)\.(gate_proj|up_proj)\.weight$")
_MTP_ONLY = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
             "shared_head.norm.weight", "shared_head.head.weight")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_names(model_dir: str | Path) -> set[str]:
    return {t.name for f in checkpoint_files(Path(model_dir)) for t in stored_tensors(f)}


def has_mtp_weights(model_dir: str | Path, cfg: ModelConfig) -> bool:
    return f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in checkpoint_names(model_dir)


def load_model(model_dir: str | Path, cfg: ModelConfig, backend: AttentionBackend, device: torch.device,
               dtype: torch.dtype, with_mtp: bool = False, aux_layers: tuple[int, ...] = ()) -> DeepseekForCausalLM:
    """``aux_layers``: target layers whose input the forward also returns (an EAGLE-3 drafter's)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, backend, with_mtp=with_mtp, aux_layers=aux_layers)
    model = model.to(dtype).to_empty(device=device)
    model.rotary.init_buffers()
    missing = copy_checkpoint(Path(model_dir), dict(model.named_parameters()),
                              lambda name: _target(name, cfg, with_mtp))
    if missing == ["lm_head.weight"] and cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = []
    if missing:
        raise ValueError(f"tensors missing from checkpoint {str(model_dir)!r}: {missing[:20]}")
    return model.eval()


def copy_checkpoint(model_dir: Path, params: dict[str, torch.nn.Parameter],
                    target: Callable[[str], tuple[str, object] | None]) -> list[str]:
    """Copies each checkpoint tensor into the parameter (or the slice of it) that ``target`` maps its
    name to (None: skip it). Unknown tensors and wrong shapes are errors that name them; returns the
    parameters left (partly) unfilled, for the caller to tie or report."""
    pending = {name: _pieces(name, p) for name, p in params.items()}
    unknown = []
    plan: list[tuple[StoredTensor, torch.Tensor]] = []
    for stored in (t for f in checkpoint_files(model_dir) for t in stored_tensors(f)):
        mapped = target(stored.name)
        if mapped is None:
            continue
        name, index = mapped
        if name not in params:
            unknown.append(stored.name)
            continue
        dest = params[name].data if index is None else params[name].data[index]
        if dest.shape != stored.shape:
            raise ValueError(f"checkpoint tensor {stored.name} has shape {stored.shape}; "
                             f"encore expects {tuple(dest.shape)} for {name}")
        plan.append((stored, dest))
        pending[name] -= 1
    if unknown:
        hint = " (fp8 block-quantized checkpoints are not supported)" if any("scale" in u for u in unknown) else ""
        raise ValueError(f"unknown tensors in checkpoint {str(model_dir)!r}{hint}: {sorted(unknown)[:20]}")
    read_into(plan)
    return sorted(n for n, left in pending.items() if left > 0)


def _pieces(name: str, param: torch.Tensor) -> int:
    """How many checkpoint tensors fill this parameter."""
    if name.endswith("experts.w13"):
        return 2 * param.shape[0]
    if name.endswith("experts.w2"):
        return param.shape[0]
    if name.endswith("gate_up_proj.weight"):
        return 2
    return 1


def _target(ckpt_name: str, cfg: ModelConfig, with_mtp: bool) -> tuple[str, object] | None:
    """Maps a checkpoint name to (encore parameter name, index into it or None); None skips it."""
    if _IGNORED.search(ckpt_name):
        return None
    m = _LAYER.match(ckpt_name)
    if m is None:
        return ckpt_name, None
    layer, rest = int(m.group(1)), m.group(2)
    if layer < cfg.num_hidden_layers:
        prefix = f"model.layers.{layer}."
    elif layer < cfg.num_hidden_layers + max(cfg.num_nextn_predict_layers, 1):
        if not with_mtp or layer > cfg.num_hidden_layers:
            return None  # MTP weights are loaded only when asked for; encore uses the first nextn layer
        if rest in _MTP_ONLY:
            return f"mtp.{rest}", None
        prefix = "mtp.layer."
    else:
        return ckpt_name, None
    expert = _EXPERT.match(rest)
    if expert:
        e, proj = int(expert.group(1)), expert.group(2)
        if proj == "down_proj":
            return f"{prefix}mlp.experts.w2", e
        half = cfg.moe_intermediate_size
        return f"{prefix}mlp.experts.w13", (e, slice(0, half) if proj == "gate_proj" else slice(half, 2 * half))
    fused = _FUSED.match(rest)
    if fused:
        module, proj = fused.group(1), fused.group(2)
        size = cfg.intermediate_size if module == "mlp" else cfg.moe_intermediate_size * cfg.n_shared_experts
        return f"{prefix}{module}.gate_up_proj.weight", slice(0, size) if proj == "gate_proj" else slice(size, 2 * size)
    return prefix + rest, None
