"""Compiled steps (Inductor on the CPU, passes on) give the eager engine's greedy tokens through
EXTEND, MIXED and DECODE steps, padded to their keys; steps that fit no key run eager; each family
(mode) compiles one graph that all its keys run on."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from torch._dynamo.utils import counters

from encore.backends.metadata import ForwardMode
from encore.backends.torch_backend import TorchAttentionBackend
from encore.engine import Engine
from graph_helpers import SMALL_KEYS, STAGGERED, staggered

# Several keys per family: 3 DECODE sizes (bs 1 among them), 8 MIXED keys of 1-2 prefill rows, 2-4 decode
# rows and 4-8 prefill tokens, 4 EXTEND keys of 1-2 rows.
FAMILY_KEYS = dict(graph_decode_sizes=(1, 2, 4), graph_mixed_extends=(1, 2), graph_mixed_decode_sizes=(2, 4),
                   graph_prefill_tokens=(4, 8), graph_extend_sizes=(1, 2))


@pytest.fixture(scope="module")
def eager_tokens(checkpoint):
    return {kind: staggered(Engine(str(checkpoint(kind)), device="cpu", **STAGGERED)) for kind in ("v2_lite", "v3")}


def check_compiled_run(engine: Engine, want: dict[str, list[int]]) -> None:
    got = staggered(engine)
    assert got == want
    stats = engine.stats()
    assert stats["compiled_keys"] == 3 and stats["recompiles"] == 0, stats
    # Steps no key holds run unpadded on their family's graph: none runs eager.
    assert stats["eager_steps"] == 0 and stats["graph_replays"] == 0, stats
    assert stats["compiled_steps"] == sum(stats["steps"].values())
    assert sum(engine.runner.graphs.steps_per_key.values()) < stats["compiled_steps"]  # some ran unpadded
    assert stats["attention_fallback_steps"] == 0  # the torch reference takes every step itself
    used = engine.runner.graphs.steps_per_key
    assert {k.mode for k, n in used.items() if n} == {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE}


def test_v2_lite_cold_compile_matches_eager(checkpoint, eager_tokens, tmp_path):
    progress = []
    engine = Engine(str(checkpoint("v2_lite")), device="cpu", compile=True, graph_cache_dir=str(tmp_path),
                    on_graph_key=lambda done, total, report: progress.append((done, total, report.key)),
                    **STAGGERED, **SMALL_KEYS)
    assert [(d, t) for d, t, _ in progress] == [(1, 3), (2, 3), (3, 3)]
    assert [k for _, _, k in progress] == list(engine.runner.graphs.keys)
    check_compiled_run(engine, eager_tokens["v2_lite"])
    manifest = json.loads(engine.runner.graph_cache.manifest_path.read_text())
    assert len(manifest["keys"]) == 3  # a cold engine start leaves a manifest like a warm-up does


@pytest.mark.parametrize("num_kv_pages", [None, 97])
def test_v3_warm_start_loads_the_warmup_precompiled_graphs_and_matches_eager(v3_dir, v3_warm_cache, eager_tokens,
                                                                              num_kv_pages):
    """Every family comes back precompiled: nothing is traced, re-traced or compiled, whatever the KV
    pool's size (the warm-up sized its pool from memory, as a start without ``num_kv_pages`` does; 97
    pages is another pool, and one page more or less is what free memory moves a GPU start's pool by)."""
    cache_dir, manifest, _ = v3_warm_cache
    frames = counters["stats"]["unique_graphs"]
    engine = Engine(str(v3_dir), device="cpu", compile=True, graph_cache_dir=str(cache_dir), num_kv_pages=num_kv_pages,
                    **STAGGERED, **SMALL_KEYS)
    assert engine.runner.num_pages != 97 if num_kv_pages is None else engine.runner.num_pages == 97
    assert counters["stats"]["unique_graphs"] == frames  # dynamo traced nothing
    stats = engine.stats()
    assert stats["loaded_graphs"] == 3 and stats["compiled_graphs"] == 0, stats
    assert json.loads(engine.runner.graph_cache.manifest_path.read_text()) == manifest  # the warm-up's record
    check_compiled_run(engine, eager_tokens["v3"])


def test_a_corrupt_precompiled_graph_is_rebuilt_with_a_warning(v3_dir, eager_tokens, tmp_path, caplog, monkeypatch):
    """Also: every family precompiles though the attention backend holds handles that do not pickle
    (flashinfer's kernel modules): the traced model never reaches into the backend object."""
    init = TorchAttentionBackend.__init__

    def with_kernel_handle(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.kernel_handle = threading.Lock()

    monkeypatch.setattr(TorchAttentionBackend, "__init__", with_kernel_handle)
    with caplog.at_level(logging.WARNING, logger="encore.graphs.compiler"):
        engine = Engine(str(v3_dir), device="cpu", compile=True, graph_cache_dir=str(tmp_path), **STAGGERED,
                        **SMALL_KEYS)
    assert "cannot be precompiled" not in caplog.text
    artifacts = engine.runner.graph_cache.precompiled_dir
    assert sorted(p.name for p in artifacts.iterdir()) == ["decode.aot", "extend.aot", "mixed.aot"]
    (artifacts / "mixed.aot").write_bytes(b"not a precompiled graph")
    with caplog.at_level(logging.WARNING, logger="encore.graphs.compiler"):
        engine = Engine(str(v3_dir), device="cpu", compile=True, graph_cache_dir=str(tmp_path), **STAGGERED,
                        **SMALL_KEYS)
    assert "precompiled MIXED graph" in caplog.text and "does not load" in caplog.text
    stats = engine.stats()
    assert stats["loaded_graphs"] == 2 and stats["compiled_graphs"] == 1 and stats["recompiles"] == 0, stats
    assert (artifacts / "mixed.aot").stat().st_size > 1000  # written anew
    check_compiled_run(engine, eager_tokens["v3"])


def test_each_family_compiles_once_for_all_its_keys_and_matches_eager(v3_dir, eager_tokens, tmp_path):
    engine = Engine(str(v3_dir), device="cpu", compile=True, graph_cache_dir=str(tmp_path), **STAGGERED, **FAMILY_KEYS)
    graphs = engine.runner.graphs
    assert len(graphs.keys) == 15
    assert staggered(engine) == eager_tokens["v3"]
    compiled = graphs.compiled
    assert compiled.compiled_graphs == 3 and compiled.recompiles == 0 and compiled.compiled_keys == 15
    used = [k for k, n in graphs.steps_per_key.items() if n]  # every key ran once while preparing; these served steps
    assert ForwardMode.EXTEND in {k.mode for k in used}
    for mode in (ForwardMode.MIXED, ForwardMode.DECODE):  # one graph, several shapes each
        assert len({(k.bs, k.num_tokens) for k in used if k.mode is mode}) >= 2, (mode, used)
    assert {k.num_extends for k in used if k.mode is ForwardMode.MIXED} == {1, 2}
    assert 1 in {k.bs for k in used if k.mode is ForwardMode.DECODE}


def test_compile_off_runs_every_step_eager(v3_dir):
    engine = Engine(str(v3_dir), device="cpu", compile=False, **STAGGERED)
    assert engine.runner.graphs is None
    staggered(engine)
    stats = engine.stats()
    assert stats["eager_steps"] == sum(stats["steps"].values()) and stats["compiled_keys"] == 0
