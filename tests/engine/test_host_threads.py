"""engine.serial_host_ops: a CUDA engine runs torch's host ops on one thread once started; a CPU
engine, whose model runs on torch's pool, keeps it."""

from __future__ import annotations

import torch

from encore.engine import Engine
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
