"""Which backend the engine runs: "auto" by what the device and the model allow, explicit names honoured
or refused with the reason (backends/selection.py)."""

from __future__ import annotations

import pytest
import torch

from encore.backends.base import MLADims
from encore.backends.selection import select_backend
from encore.backends.torch_backend import TorchAttentionBackend

V2_DIMS = MLADims(16, 128, 64, 128, 512, 192 ** -0.5)  # DeepSeek-V2(-Lite) attention
TINY_DIMS = MLADims(4, 64, 32, 64, 128, 96 ** -0.5)  # encore-tiny: rope 32, which flashinfer's MLA lacks
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_gets_the_torch_reference():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, V2_DIMS, torch.float32) is TorchAttentionBackend
    assert select_backend("torch", cpu, V2_DIMS, torch.bfloat16) is TorchAttentionBackend


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_cuda_backends_refused_on_cpu(name):
    with pytest.raises(ValueError, match=f"'{name}' needs a CUDA device, got device 'cpu'"):
        select_backend(name, torch.device("cpu"), V2_DIMS, torch.bfloat16)


def test_unknown_name_is_named():
    with pytest.raises(ValueError, match="got 'flash'"):
        select_backend("flash", torch.device("cpu"), V2_DIMS, torch.float32)


def test_engine_refuses_triton_on_cpu():
    from encore.engine import Engine

    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(device="cpu", dtype="float32", attention_backend="triton", max_model_len=64)


@pytest.mark.gpu
@needs_cuda
def test_auto_on_cuda_routes_by_what_flashinfer_takes():
    from encore.backends.flashinfer_backend import AutoFlashInferAttentionBackend, FlashInferAttentionBackend
    from encore.backends.triton_backend import TritonAttentionBackend

    cuda = torch.device("cuda")
    assert select_backend("auto", cuda, V2_DIMS, torch.bfloat16) is AutoFlashInferAttentionBackend
    assert select_backend("flashinfer", cuda, V2_DIMS, torch.bfloat16) is FlashInferAttentionBackend
    assert select_backend("auto", cuda, V2_DIMS, torch.float32) is TritonAttentionBackend  # fa3 MLA: fp16/bf16
    assert select_backend("auto", cuda, TINY_DIMS, torch.bfloat16) is TritonAttentionBackend
    assert select_backend("triton", cuda, V2_DIMS, torch.bfloat16) is TritonAttentionBackend
    with pytest.raises(ValueError, match="float16/bfloat16 only, got dtype torch.float32"):
        select_backend("flashinfer", cuda, V2_DIMS, torch.float32)
    with pytest.raises(ValueError, match="qk_rope_head_dim a multiple of 64, got 128 and 32"):
        select_backend("flashinfer", cuda, TINY_DIMS, torch.bfloat16)
