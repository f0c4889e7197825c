"""model_runner.serial_host_ops: a CUDA model runner runs torch's host ops on one thread from before
its graphs compile; a CPU engine, whose model runs on torch's pool, keeps it."""

from __future__ import annotations

import logging

import torch

from encore.engine import Engine, SamplingParams
from encore.engine import model_runner
from encore.engine.model_runner import serial_host_ops
from encore.graphs.warmup import warmup
from encore.models.tiny import default_model_dir


def test_only_a_cuda_engine_gives_up_the_pool(monkeypatch):
    set_to = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    serial_host_ops(torch.device("cpu"))
    assert set_to == []
    serial_host_ops(torch.device("cuda", 0))
    assert set_to == [1]


def test_a_cpu_engine_keeps_the_pool():
    before = torch.get_num_threads()
    Engine(device="cpu", max_model_len=64)
    assert torch.get_num_threads() == before


def test_graphs_compile_on_the_thread_count_they_run_on(monkeypatch, tmp_path, caplog):
    """dynamo guards a compiled graph on torch's thread count: compiled under the pool and called on
    one thread, it rejected every call, and a step that no key holds ran eager (found on the GPU
    machine). Here the CPU gives up a 2-thread pool as a CUDA model runner does: the graph cache that
    ``encore graphs warmup`` writes loads in an engine with nothing compiled again, and the engine's
    100-token prompt, past every key, runs on the compiled graph. A rejected call is logged with
    dynamo's reason."""
    before = torch.get_num_threads()
    monkeypatch.setattr(model_runner, "serial_host_ops", lambda device: torch.set_num_threads(1))
    options = dict(compile=True, max_model_len=256, max_num_seqs=4, graph_decode_sizes=(1,),
                   graph_mixed_decode_sizes=(1,), graph_prefill_tokens=(32,), graph_extend_sizes=(1,),
                   graph_mixed_extends=(1,))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        torch.set_num_threads(2)
        warmup(default_model_dir(), device="cpu", cache_dir=tmp_path, progress=False, **options)
        torch.set_num_threads(2)
        engine = Engine(device="cpu", graph_cache_dir=str(tmp_path), **options)
        engine.generate([list(range(5, 105))], params)
        stats = engine.stats()
        assert stats["loaded_graphs"] == 3 and stats["recompiles"] == 0 and stats["eager_steps"] == 0, stats
        # Called on another thread count, the graph rejects the step: it runs eager, and the log says why.
        torch.set_num_threads(2)
        with caplog.at_level(logging.WARNING, logger="encore.graphs.compiler"):
            engine.generate([list(range(110, 210))], params)  # no page of it cached
    finally:
        torch.set_num_threads(before)
    assert engine.stats()["eager_steps"] == 1
    assert "EXTEND graph's guards reject" in caplog.text and "num_threads" in caplog.text
