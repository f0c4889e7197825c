"""Owns the model, its latent KV cache and attention backend, and runs one forward + sample."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from encore.backends.base import AttentionBackend, MLADims
from encore.backends.metadata import ForwardBatch
from encore.backends.torch_backend import TorchAttentionBackend
from encore.engine.config import EngineConfig
from encore.engine.kv_cache import allocate_kv_caches
from encore.engine.sampler import Sampler, SamplerOutput, SamplingTensors
from encore.models.config import ModelConfig
from encore.models.deepseek import DeepseekForCausalLM
from encore.models.loader import load_model

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def select_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """Chosen once. Only the torch reference exists so far; "auto" resolves to it everywhere."""
    if name in ("auto", "torch"):
        return TorchAttentionBackend
    raise ValueError(f"attention_backend {name!r} is not available; expected 'auto' or 'torch'")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        cfg = model_config
        self.dims = MLADims(cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                            cfg.kv_lora_rank, cfg.softmax_scale)
        num_layers = cfg.num_hidden_layers
        self.num_pages = config.num_kv_pages or self._size_pool(config, cfg, num_layers, max_model_len)
        self.kv_caches = allocate_kv_caches(num_layers, self.num_pages, config.page_size, cfg.latent_dim,
                                            self.dtype, self.device)
        self.backend = select_backend(config.attention_backend, self.device)(self.kv_caches, self.dims)
        self.model: DeepseekForCausalLM = load_model(Path(config.model), cfg, self.backend, self.device, self.dtype)
        self.sampler = Sampler()

    def _size_pool(self, config: EngineConfig, cfg: ModelConfig, num_layers: int, max_model_len: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        page_bytes = num_layers * config.page_size * cfg.latent_dim * elem
        if self.device.type == "cuda":
            with torch.device("meta"):
                param_bytes = sum(p.numel() for p in DeepseekForCausalLM(cfg, None).parameters()) * elem
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int((free - param_bytes) * config.kv_cache_memory_fraction)
        else:
            wanted = config.max_num_seqs * -(-max_model_len // config.page_size) * page_bytes
            budget = min(wanted, config.cpu_kv_cache_bytes)
        pages = budget // page_bytes + 1
        if pages < 2:
            raise RuntimeError(f"no memory left for the KV cache on {self.device} (budget {budget} bytes)")
        log.info("KV cache: %d pages of %d tokens (%.1f MiB)", pages, config.page_size, pages * page_bytes / 2**20)
        return pages

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, sampling: SamplingTensors) -> SamplerOutput:
        self.backend.plan(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, hidden]
        logits = self.model.compute_logits(hidden[batch.gather_ids])  # [N, V]
        return self.sampler(logits, sampling)
