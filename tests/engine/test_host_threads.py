"""engine.serial_host_ops: a CUDA engine runs torch's host ops on one thread from before its graphs
compile; a CPU engine, whose model runs on torch's pool, keeps it."""

from __future__ import annotations

import logging

import torch

from encore.engine import Engine, SamplingParams
from encore.engine import engine as engine_module
from encore.engine.engine import serial_host_ops


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
    machine). Here the CPU engine gives up a 2-thread pool as a CUDA engine does; its 100-token
    prompt, past every key, must run on the compiled graph, and nothing compiles again. A rejected
    call is logged with dynamo's reason."""
    before = torch.get_num_threads()
    monkeypatch.setattr(engine_module, "serial_host_ops", lambda device: torch.set_num_threads(1))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        torch.set_num_threads(2)
        engine = Engine(device="cpu", compile=True, graph_cache_dir=str(tmp_path), max_model_len=256,
                        max_num_seqs=4, graph_decode_sizes=(1,), graph_mixed_decode_sizes=(1,),
                        graph_prefill_tokens=(32,), graph_extend_sizes=(1,), graph_mixed_extends=(1,))
        engine.generate([list(range(5, 105))], params)
        stats = engine.stats()
        assert stats["eager_steps"] == 0 and stats["recompiles"] == 0, stats
        # Called on another thread count, the graph rejects the step: it runs eager, and the log says why.
        torch.set_num_threads(2)
        with caplog.at_level(logging.WARNING, logger="encore.graphs.compiler"):
            engine.generate([list(range(110, 210))], params)  # no page of it cached
    finally:
        torch.set_num_threads(before)
    assert engine.stats()["eager_steps"] == 1
    assert "EXTEND graph's guards reject" in caplog.text and "num_threads" in caplog.text
