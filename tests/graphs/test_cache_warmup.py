"""`graphs warmup` / `graphs list` and the graph cache: manifest, progress, stale and corrupt caches."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import subprocess
import sys

import pytest

from encore.engine.config import EngineConfig
from encore.graphs.cache import GraphCache
from encore.graphs.keys import GraphKey
from encore.graphs.runner import KeyReport
from encore.graphs.warmup import Progress, add_graphs_subcommands, list_manifest
from encore.models.config import ModelConfig


def test_warmup_compiles_every_key_with_progress_and_writes_the_manifest(v3_warm_cache):
    cache_dir, manifest, progress = v3_warm_cache
    assert [(k["mode"], k["bs"], k["num_tokens"]) for k in manifest["keys"]] == [
        ("MIXED", 5, 12), ("EXTEND", 2, 8), ("DECODE", 4, 4)]  # largest first
    assert all(k["compile_s"] > 0 and k["capture_s"] == 0 for k in manifest["keys"])  # CPU: nothing captured
    assert all(k["graphs_compiled"] == 1 for k in manifest["keys"])  # one key per family here
    assert {mode: (f["keys"], f["graphs_compiled"]) for mode, f in manifest["families"].items()} == {
        "MIXED": (1, 1), "EXTEND": (1, 1), "DECODE": (1, 1)}
    assert manifest["identity"]["versions"]["torch"]
    for n in (1, 2, 3):
        assert f"key {n}/3" in progress
    assert "ETA" in progress and "elapsed" in progress and "warm-up done" in progress
    (entry,) = cache_dir.iterdir()
    assert (entry / "inductor").is_dir() and any((entry / "inductor").iterdir())


def test_list_prints_each_key(v3_warm_cache):
    cache_dir, manifest, _ = v3_warm_cache
    out = io.StringIO()
    assert list_manifest(cache_dir, out=out) == [manifest]
    text = out.getvalue()
    assert "DeepseekV3ForCausalLM" in text and "3 keys" in text
    lines = [line.strip() for line in text.splitlines()]
    assert sum(line.startswith(("MIXED ", "EXTEND ", "DECODE ")) for line in lines) == 3
    assert sum(line.startswith("family ") and ": 1 keys, 1 graph(s) compiled, 0 loaded" in line for line in lines) == 3


@pytest.fixture
def small_cache(v3_dir, tmp_path):
    """A graph cache with a manifest and a (fake) artifact, made without compiling anything."""
    config = EngineConfig(model=str(v3_dir), device="cpu", compile=True, graph_cache_dir=str(tmp_path))
    cache = GraphCache.for_engine(config, ModelConfig.from_pretrained(v3_dir))
    cache.inductor_dir.mkdir(parents=True)
    (cache.inductor_dir / "artifact").write_text("x")
    cache.write_manifest([KeyReport(GraphKey(0, 1, 4, 4), 1.5, 0.0, 0)])
    return cache


def test_sound_cache_is_used(small_cache):
    manifest = small_cache.read_manifest()
    assert manifest["keys"][0]["bs"] == 4
    assert manifest["families"] == {"DECODE": {"keys": 1, "graphs_compiled": 0, "graphs_loaded": 0, "compile_s": 0.0,
                                               "run_s": 1.5}}


def test_list_shows_whether_the_drafters_graph_is_precompiled(v3_dir, tmp_path):
    config = EngineConfig(model=str(v3_dir), device="cpu", compile=True, graph_cache_dir=str(tmp_path))
    cache = GraphCache.for_engine(config, ModelConfig.from_pretrained(v3_dir), {"method": "mtp", "config": None})
    cache.inductor_dir.mkdir(parents=True)
    cache.write_manifest([KeyReport(GraphKey(0, 3, 4, 12), 1.5, 0.0, 0)])
    out = io.StringIO()
    list_manifest(tmp_path, out=out)
    assert "drafter mtp: no precompiled graph (" in out.getvalue()
    cache.drafter_artifact.parent.mkdir(parents=True)
    cache.drafter_artifact.write_bytes(b"x")
    out = io.StringIO()
    list_manifest(tmp_path, out=out)
    assert "drafter mtp: graph precompiled\n" in out.getvalue()


def test_family_summary_splits_compile_or_load_from_runs(small_cache):
    reports = [KeyReport(GraphKey(0, 1, 8, 8), 9.0, 0.5, 0, graphs_compiled=1),
               KeyReport(GraphKey(0, 1, 4, 4), 0.25, 0.5, 0), KeyReport(GraphKey(0, 1, 2, 2), 0.25, 0.5, 0),
               KeyReport(GraphKey(1, 1, 1, 8), 2.0, 0.5, 0, graphs_loaded=1)]
    families = small_cache.write_manifest(reports)["families"]
    assert families == {"DECODE": {"keys": 3, "graphs_compiled": 1, "graphs_loaded": 0, "compile_s": 9.0, "run_s": 0.5},
                         "EXTEND": {"keys": 1, "graphs_compiled": 0, "graphs_loaded": 1, "compile_s": 2.0,
                                    "run_s": 0.0}}


@pytest.mark.parametrize("damage, reason", [
    (lambda c: c.manifest_path.write_text("{ truncated"), "unreadable manifest"),
    (lambda c: c.manifest_path.write_text(json.dumps({**json.loads(c.manifest_path.read_text()), "format": 0})),
     "manifest format 0"),
    (lambda c: c.manifest_path.write_text(json.dumps(
        {**json.loads(c.manifest_path.read_text()), "identity": {"versions": {"torch": "1.0"}}})), "another model"),
    (lambda c: (c.inductor_dir / "artifact").unlink(), "compile artifacts are missing"),
])
def test_stale_or_corrupt_cache_is_deleted_with_a_warning(small_cache, damage, reason, caplog):
    damage(small_cache)
    with caplog.at_level(logging.WARNING, logger="encore.graphs.cache"):
        assert small_cache.read_manifest() is None
    assert reason in caplog.text and "rebuilding" in caplog.text
    assert not small_cache.root.exists()


def test_cli_subcommands_parse_and_list(v3_warm_cache, capsys):
    cache_dir, _, _ = v3_warm_cache
    parser = argparse.ArgumentParser(prog="encore")
    add_graphs_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["graphs", "warmup", "--model", "m", "--device", "cpu",
                              "--graph-decode-sizes", "1,2,4", "--page-size", "8"])
    assert args.graph_decode_sizes == (1, 2, 4) and args.page_size == 8 and callable(args.run)
    args = parser.parse_args(["graphs", "list", "--cache-dir", str(cache_dir)])
    assert args.run(args) == 0
    assert "3 keys" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["graphs", "warmup", "--model", "m", "--graph-decode-sizes", "1,x"])


def test_warmup_takes_the_servers_engine_options(monkeypatch, tmp_path):
    """The same engine flags give ``graphs warmup`` and ``serve`` the same Engine options (so the same
    graph cache identity and keys), and the warm-up runs with them in the cache directory given."""
    import encore.graphs.warmup as warmup_module
    from encore.engine.cli_options import engine_kwargs
    from encore.server.cli import build_parser

    flags = ["--model", "m", "--device", "cuda:1", "--dtype", "bfloat16", "--attention-backend", "triton",
             "--page-size", "64", "--no-mixed-batch", "--graph-decode-sizes", "1,8", "--graph-prefill-tokens", "512",
             "--speculative-method", "mtp", "--num-speculative-tokens", "3", "--graph-cache-dir", str(tmp_path)]
    parser = build_parser()
    warm, serve = parser.parse_args(["graphs", "warmup", *flags]), parser.parse_args(["serve", *flags])
    assert engine_kwargs(warm) == engine_kwargs(serve)
    assert engine_kwargs(warm)["speculative"]["num_speculative_tokens"] == 3
    calls = []
    monkeypatch.setattr(warmup_module, "warmup", lambda **kwargs: calls.append(kwargs))
    assert warm.run(warm) == 0
    want = {k: v for k, v in engine_kwargs(serve).items() if k != "graph_cache_dir"}
    assert calls == [{"cache_dir": str(tmp_path), **want}]
    assert parser.parse_args(["graphs", "warmup"]).device == "cuda" and parser.parse_args(["serve"]).device == "auto"


def test_progress_eta_charges_a_compile_to_each_family_not_yet_compiled():
    keys = (GraphKey(0, 1, 8, 8), GraphKey(0, 1, 4, 4), GraphKey(0, 1, 2, 2), GraphKey(1, 1, 1, 8))
    out = io.StringIO()
    progress = Progress(keys, out)
    progress(0, KeyReport(keys[0], 10.0, 0.0, 0, graphs_compiled=1))
    progress(1, KeyReport(keys[1], 1.0, 0.0, 0))
    progress(2, KeyReport(keys[2], 1.0, 0.0, 0))
    progress(3, KeyReport(keys[3], 2.0, 0.0, 0, graphs_loaded=1))
    first, second, _, fourth = out.getvalue().splitlines()
    assert "key 1/4" in first and "compile 10.0s" in first and first.endswith("ETA 0m30s")  # EXTEND: 10s, D2: 10s
    assert "key 2/4" in second and "run 1.0s" in second and second.endswith("ETA 0m11s")  # EXTEND: 10s, D2: 1s
    assert "key 4/4" in fourth and "load 2.0s" in fourth and fourth.endswith("ETA 0m00s")


def test_list_reports_an_older_manifest_format_by_its_format(tmp_path):
    entry = tmp_path / "0123456789abcdef"
    entry.mkdir()
    (entry / "manifest.json").write_text(json.dumps({"format": 2, "keys": [], "identity": {}}))  # no "families"
    out = io.StringIO()
    assert list_manifest(tmp_path, out=out) == []
    assert "manifest format 2; it will be rebuilt" in out.getvalue()


def test_identity_follows_inductor_settings(v3_dir, tmp_path):
    """A TORCHINDUCTOR_* variable (here Inductor's PDL switch) changes what a precompiled graph holds,
    so it must change the cache directory; the same settings give the same one in another process."""
    from torch._inductor import config as inductor_config

    from encore.graphs.cache import identity, inductor_config_digest

    config = EngineConfig(model=str(v3_dir), device="cpu", compile=True, graph_cache_dir=str(tmp_path))
    model_config = ModelConfig.from_pretrained(v3_dir)
    before = GraphCache.for_engine(config, model_config).root
    with inductor_config.patch({"triton.enable_pdl": not inductor_config.triton.enable_pdl}):
        assert GraphCache.for_engine(config, model_config).root != before
    assert GraphCache.for_engine(config, model_config).root == before
    child = subprocess.run([sys.executable, "-c", "from encore.graphs.cache import inductor_config_digest; "
                            "print(inductor_config_digest())"], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == inductor_config_digest() == identity(config, model_config)["inductor_config"]


def test_identity_follows_the_model_drafter(v3_dir, tmp_path):
    """The cache also holds a model drafter's graph: another drafter (or an EAGLE-3 draft model of
    another config) is another cache."""
    config = EngineConfig(model=str(v3_dir), device="cpu", compile=True, graph_cache_dir=str(tmp_path))
    model_config = ModelConfig.from_pretrained(v3_dir)
    drafters = (None, {"method": "mtp", "config": None}, {"method": "eagle3", "config": {"hidden_size": 64}},
                {"method": "eagle3", "config": {"hidden_size": 128}})
    roots = {GraphCache.for_engine(config, model_config, drafter).root for drafter in drafters}
    assert len(roots) == 4


def test_flashinfer_builds_go_beside_the_identities_unless_a_directory_is_set(v3_dir, tmp_path, monkeypatch):
    """flashinfer keys its JIT builds itself (its version, the GPU architecture), so every identity shares
    one directory under the cache root; a FLASHINFER_WORKSPACE_BASE the user set is left as it is."""
    config = EngineConfig(model=str(v3_dir), device="cpu", compile=True, graph_cache_dir=str(tmp_path))
    model_config = ModelConfig.from_pretrained(v3_dir)
    caches = [GraphCache.for_engine(c, model_config) for c in (config, dataclasses.replace(config, page_size=32))]
    assert caches[0].root != caches[1].root
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", "")  # recorded, so the variable is restored (here: removed)
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE")
    seen = []
    for cache in caches:
        with cache.active():
            seen.append(os.environ["FLASHINFER_WORKSPACE_BASE"])
    assert seen == [str(tmp_path / "flashinfer")] * 2
    assert "FLASHINFER_WORKSPACE_BASE" not in os.environ
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "mine"))
    with caches[0].active():
        assert os.environ["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "mine")
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "mine")
