"""The per-family compile driver: one dynamo cache per family, shared by its keys' sizes; recompiles
counted and bounded per family."""

from __future__ import annotations

import torch
from torch import nn

from encore.backends.metadata import ForwardMode
from encore.graphs.compiler import CompiledModel
from encore.graphs.keys import GraphKey


class Doubler(nn.Module):
    def forward(self, input_ids, positions, batch):
        return input_ids * 2 + positions


class Batch:
    def __init__(self, tokens: int, dtype: torch.dtype = torch.int64) -> None:
        self.input_ids = torch.arange(tokens, dtype=dtype)
        self.positions = torch.zeros(tokens, dtype=dtype)


class CountingPass:
    def __init__(self, runs: list) -> None:
        self.runs = runs
        self.matches = 0

    def __call__(self, graph) -> None:
        self.runs.append(graph)


def test_a_family_compiles_once_for_all_its_sizes_and_recompiles_are_counted_then_bounded():
    runs = []
    compiled = CompiledModel(Doubler(), lambda family: [CountingPass(runs)], inductor=False)
    decodes = [GraphKey(0, 1, bs, bs) for bs in (8, 4, 2, 1)] + [GraphKey(0, 3, 2, 6)]  # bs 1 too: T = 1
    extend = GraphKey(1, 1, 1, 4)
    for key in (*decodes, extend, *decodes):
        assert compiled(key, Batch(key.num_tokens)).tolist() == [2 * i for i in range(key.num_tokens)]
    assert compiled.compiled_keys == 6 and compiled.compiled_graphs == 2 and compiled.recompiles == 0
    for dtype in (torch.int32, torch.int16, torch.float32):  # each fails a dtype guard of the DECODE graph
        assert compiled(decodes[0], Batch(8, dtype)).tolist() == [2 * i for i in range(8)]
    assert compiled.records[ForwardMode.DECODE].compiles == 4 and compiled.recompiles == 3
    assert compiled.records[ForwardMode.EXTEND].compiles == 1
    assert len(runs) == 2 + 1  # DECODE compiled twice (the bound), then ran uncompiled; EXTEND once
