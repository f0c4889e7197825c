"""EngineConfig: what the user asked for, validated once. Values found at start-up (page count,
EOS ids, the effective context length) live in the engine's runtime state, never written back."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("auto", "torch")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """
    ``max_num_batched_tokens``: token budget of one step (decode rows claim it first).
    ``chunked_prefill_size``: the most prompt tokens one request may prefill in a step.
    ``page_size``: tokens per KV page. ``num_kv_pages``: pool size (None: sized from memory).
    ``kv_cache_memory_fraction``: on CUDA, the share of free GPU memory (after weights) given to
    the KV cache when ``num_kv_pages`` is None; on CPU the pool is sized to hold ``max_num_seqs``
    full-length sequences, capped by ``cpu_kv_cache_bytes``.
    ``enable_mixed_batch``: False runs prefill-only and decode-only steps (a baseline).
    """

    model: str
    device: str = "cuda"
    dtype: str = "auto"
    attention_backend: str = "auto"
    max_num_batched_tokens: int = 8192
    chunked_prefill_size: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    page_size: int = 16
    num_kv_pages: int | None = None
    kv_cache_memory_fraction: float = 0.85
    cpu_kv_cache_bytes: int = 2 << 30
    enable_mixed_batch: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        for name in ("max_num_batched_tokens", "chunked_prefill_size", "max_num_seqs", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise ValueError(f"num_kv_pages must be >= 2 (page 0 is reserved), got {self.num_kv_pages!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
