"""The per-key compile driver: one dynamo cache per key, recompiles counted and bounded."""

from __future__ import annotations

import torch
from torch import nn

from encore.graphs.compiler import CompiledModel
from encore.graphs.keys import GraphKey


class Doubler(nn.Module):
    def forward(self, input_ids, positions, batch):
        return input_ids * 2 + positions


class Batch:
    def __init__(self, dtype: torch.dtype) -> None:
        self.input_ids = torch.arange(4, dtype=dtype)
        self.positions = torch.zeros(4, dtype=dtype)


class CountingPass:
    def __init__(self, runs: list) -> None:
        self.runs = runs
        self.matches = 0

    def __call__(self, graph) -> None:
        self.runs.append(graph)


def test_keys_compile_separately_and_recompiles_are_counted_then_bounded():
    runs = []
    compiled = CompiledModel(Doubler(), lambda key: [CountingPass(runs)], inductor=False)
    a, b = GraphKey(0, 1, 4, 4), GraphKey(1, 1, 1, 4)
    for key in (a, b, a, b):
        assert compiled(key, Batch(torch.int64)).tolist() == [0, 2, 4, 6]
    assert compiled.compiled_keys == 2 and compiled.recompiles == 0  # one compile per key, reused
    for dtype in (torch.int32, torch.int16, torch.float32):  # each fails a dtype guard of key a
        assert compiled(a, Batch(dtype)).tolist() == [0, 2, 4, 6]
    assert compiled.records[a].compiles == 4 and compiled.recompiles == 3
    assert compiled.records[b].compiles == 1
    assert len(runs) == 2 + 1  # key a compiled twice (the bound), then ran uncompiled; key b once
