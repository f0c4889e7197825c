"""Which attention backend an engine runs: chosen once, at construction (STYLE.md rule 5)."""

from __future__ import annotations

import logging

import torch

from encore.backends import BACKENDS
from encore.backends.base import AttentionBackend, MLADims
from encore.backends.torch_backend import TorchAttentionBackend

log = logging.getLogger(__name__)


def select_backend(name: str, device: torch.device, dims: MLADims, dtype: torch.dtype) -> type[AttentionBackend]:
    """``"auto"``: flashinfer where its MLA kernels take the model (importable, sm90+, fp16/bf16, MLA
    dims it compiles), with its q_len-1 decode steps and small verify steps on the Triton kernel, faster
    there (``AutoFlashInferAttentionBackend``); else Triton on CUDA, else the torch reference. An explicit
    name is honoured or refused with the reason, never swapped silently."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        if device.type != "cuda":
            return TorchAttentionBackend
        from encore.backends.flashinfer_backend import AutoFlashInferAttentionBackend, unsupported_reason

        reason = unsupported_reason(dims, dtype, device)
        if reason is None:
            return AutoFlashInferAttentionBackend
        log.info("attention backend: triton (flashinfer %s)", reason)
        name = "triton"
    if name == "torch":
        return TorchAttentionBackend
    if device.type != "cuda":
        raise ValueError(f"attention_backend {name!r} needs a CUDA device, got device {str(device)!r}; "
                         "use 'torch' (or 'auto') there")
    if name == "triton":
        from encore.backends.triton_backend import TritonAttentionBackend  # triton is imported on first use

        return TritonAttentionBackend
    from encore.backends.flashinfer_backend import FlashInferAttentionBackend, unsupported_reason

    reason = unsupported_reason(dims, dtype, device)
    if reason is not None:
        raise ValueError(f"attention_backend 'flashinfer' {reason}; use 'triton' or 'auto'")
    return FlashInferAttentionBackend
