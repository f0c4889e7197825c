"""EngineConfig's compiled-graph settings: device defaults, normalization, and refused values."""

from __future__ import annotations

import pytest

from encore.engine.config import EngineConfig


def test_compile_and_cuda_graphs_default_on_for_cuda_only():
    cpu, cuda = EngineConfig(model="m", device="cpu"), EngineConfig(model="m", device="cuda:0")
    assert (cpu.use_compile, cpu.use_cuda_graphs) == (False, False)
    assert (cuda.use_compile, cuda.use_cuda_graphs) == (True, True)
    assert EngineConfig(model="m", device="cpu", compile=True).use_compile
    assert not EngineConfig(model="m", device="cuda", cuda_graphs=False).use_cuda_graphs


def test_sizes_are_normalized_once_and_may_be_empty():
    config = EngineConfig(model="m", device="cpu", graph_decode_sizes=[8, 2, 2, 4], graph_mixed_extends=())
    assert config.graph_decode_sizes == (2, 4, 8) and config.graph_mixed_extends == ()


@pytest.mark.parametrize("options, message", [
    (dict(cuda_graphs=True), "cuda_graphs=True needs a CUDA device, got device 'cpu'"),
    (dict(compile="yes"), "compile must be True, False or None"),
    (dict(graph_q_lens=()), "graph_q_lens must name at least one decode q_len"),
    (dict(graph_decode_sizes=8), "graph_decode_sizes must be a sequence of integers"),
    (dict(graph_prefill_tokens=(64, 0)), r"graph_prefill_tokens .* got \(64, 0\)"),
    (dict(graph_q_lens=(1.5,)), "graph_q_lens"),
    (dict(graph_mixed_extends=(True,)), "graph_mixed_extends"),
])
def test_bad_graph_settings_name_the_value(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", device="cpu", **options)
