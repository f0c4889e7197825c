"""CUDA-graph replay against eager on the GPU (torch backend): greedy tokens identical through
DECODE, MIXED and EXTEND keys, steps padded to keys between them, eager fallback for the rest."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch._dynamo.utils import counters

from encore.backends.metadata import ForwardMode
from encore.engine import Engine, SamplingParams
from encore.graphs.warmup import warmup
from graph_helpers import SMALL_KEYS, STAGGERED, engine_with_history, rel_err, staggered

pytestmark = pytest.mark.gpu

# float32 for token identity (no bf16 rounding between padded and unpadded GEMMs); a small KV pool,
# since on CUDA an engine otherwise takes most of the free memory.
FP32 = dict(device="cuda", dtype="float32", num_kv_pages=512)


@pytest.fixture(scope="module")
def eager_tokens(checkpoint):
    return {kind: staggered(Engine(str(checkpoint(kind)), compile=False, cuda_graphs=False, **FP32, **STAGGERED))
            for kind in ("v2_lite", "v3")}


@pytest.mark.parametrize("kind, compile", [("v3", False), ("v3", True), ("v2_lite", True)])
def test_replay_matches_eager_through_every_mode(kind, compile, checkpoint, eager_tokens, tmp_path):
    engine = Engine(str(checkpoint(kind)), compile=compile, cuda_graphs=True, graph_cache_dir=str(tmp_path),
                    **FP32, **STAGGERED, **SMALL_KEYS)
    assert staggered(engine) == eager_tokens[kind]
    stats = engine.stats()
    # Steps no key holds: unpadded on their family's compiled graph, or eager when compiling is off.
    unkeyed, other = ("compiled_steps", "eager_steps") if compile else ("eager_steps", "compiled_steps")
    assert stats["graph_replays"] > 0 and stats[unkeyed] > 0 and stats[other] == 0, stats
    assert stats["graph_replays"] + stats[unkeyed] == sum(stats["steps"].values())
    assert stats["recompiles"] == 0 and stats["compiled_keys"] == (3 if compile else 0)
    used = engine.runner.graphs.steps_per_key
    assert {k.mode for k, n in used.items() if n} == {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE}


@pytest.mark.parametrize("compile", [False, True])
def test_decode_sweep_pads_every_batch_size_to_the_next_key(compile, v3_dir, tmp_path):
    # 7 requests finishing one step apart: decode steps of 7, 6, ..., 1 rows on keys 8, 4, 2 (and 1 eager-free).
    prompts = [[3 + i, 40 + i, 90 + 2 * i] for i in range(7)]
    params = [SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True) for i in range(7)]
    want = Engine(str(v3_dir), compile=False, cuda_graphs=False, **FP32).generate(prompts, params)
    engine = Engine(str(v3_dir), compile=compile, cuda_graphs=True, graph_cache_dir=str(tmp_path),
                    graph_decode_sizes=(1, 2, 4, 8), graph_mixed_extends=(), graph_extend_sizes=(), **FP32)
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    used = engine.runner.graphs.steps_per_key
    assert {k.bs for k, n in used.items() if n} == {1, 2, 4, 8}
    stats = engine.stats()
    # Every DECODE step is all greedy: its tokens come from its key's greedy head graph.
    assert stats["graph_replays"] == stats["head_graph_replays"] == stats["steps"]["DECODE"], stats
    if compile:  # one dynamic-shape DECODE graph, captured at bs 8, 4, 2 and 1
        assert engine.runner.graphs.compiled.compiled_graphs == 1 and engine.stats()["recompiles"] == 0


def test_bf16_replay_is_close_to_eager(v3_dir, tmp_path):
    engine, batches = engine_with_history(v3_dir, device="cuda", dtype="bfloat16", num_kv_pages=512,
                                          compile=True, cuda_graphs=True,
                                          graph_decode_sizes=(4,), graph_mixed_extends=(1,),
                                          graph_mixed_decode_sizes=(4,), graph_prefill_tokens=(8,),
                                          graph_extend_sizes=(1,), graph_cache_dir=str(tmp_path))
    runner = engine.runner
    for mode, batch in batches.items():
        replays = runner.graphs.graph_replays
        got = runner.forward(batch)
        assert runner.graphs.graph_replays == replays + 1, mode
        with torch.inference_mode(), runner.context.bind(batch):
            want = runner.model(batch.input_ids, batch.positions, batch)
        assert rel_err(got.float(), want.float()) < 3e-2, mode


def test_warmup_then_warm_start_only_captures(v3_dir, tmp_path):
    keys = dict(graph_decode_sizes=(4,), graph_mixed_extends=(), graph_extend_sizes=(), num_kv_pages=512)
    manifest = warmup(v3_dir, device="cuda", cache_dir=tmp_path, out=io.StringIO(), dtype="bfloat16", **keys)
    (key,) = manifest["keys"]
    assert key["capture_s"] > 0 and key["pool_bytes"] > 0
    frames = counters["stats"]["unique_graphs"]
    # A pool of another size: what another start's free memory gives (graphs/compiler.py, "What is symbolic").
    engine = Engine(str(v3_dir), device="cuda", dtype="bfloat16", graph_cache_dir=str(tmp_path),
                    **{**keys, "num_kv_pages": 509})
    assert counters["stats"]["unique_graphs"] == frames  # the family was loaded precompiled, not traced
    stats = engine.stats()
    assert stats["loaded_graphs"] == 1 and stats["compiled_graphs"] == 0, stats
    assert json.loads(engine.runner.graph_cache.manifest_path.read_text()) == manifest
    replays = stats["graph_replays"]
    engine.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert engine.stats()["graph_replays"] > replays


def test_warmup_builds_the_drafter_and_a_warm_start_loads_it(tmp_path):
    """With an MTP drafter, `graphs warmup` also compiles the drafter's graph into the cache; an engine
    started on that cache, with a KV pool of another size, then traces nothing (target families and
    drafter loaded precompiled) and drafts the tokens an eager engine does."""
    from encore.models.tiny import default_model_dir

    model = default_model_dir()
    options = dict(dtype="float32", num_kv_pages=512, graph_decode_sizes=(4,), graph_mixed_extends=(),
                   graph_extend_sizes=(), speculative={"method": "mtp", "num_speculative_tokens": 2})
    out = io.StringIO()
    warmup(model, device="cuda", cache_dir=tmp_path, out=out, **options)
    assert "drafter graph compiled" in out.getvalue()
    frames = counters["stats"]["unique_graphs"]
    engine = Engine(str(model), device="cuda", graph_cache_dir=str(tmp_path), **{**options, "num_kv_pages": 509})
    assert counters["stats"]["unique_graphs"] == frames
    stats = engine.stats()
    assert stats["drafter_loaded"] and stats["drafter_compiles"] == 0, stats
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = Engine(str(model), device="cuda", compile=False, cuda_graphs=False, **options)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    stats = engine.stats()
    assert stats["drafter_graph_replays"] > 0 and stats["spec_accepted_tokens"] > 0, stats
