"""``encore graphs warmup`` and ``encore graphs list``: build the graph cache ahead of serving.

``warmup`` loads the model and prepares every graph key with a progress line per key: the first key
of each family (mode) compiles the family's graph, every key runs it and, on CUDA, captures its own
CUDA graph (graphs/compiler.py). It works inside the graph cache of this model + configuration
(graphs/cache.py) and writes its manifest. A later engine start with the same model, graph settings
and versions finds the cache: the families (and a model drafter's graph) load precompiled where torch
can (graphs/compiler.py), else Inductor's compile work is read back and dynamo traces each family
once; the CUDA graphs are captured again (they cannot be stored). ``list_manifest`` prints what the
cache holds.

The CLI itself lives in server/cli.py; it calls ``add_graphs_subcommands(subparsers)`` to get both
commands, each of which sets ``run`` (``args.run(args) -> int``, server/cli.py's convention).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from encore.engine.cli_options import add_engine_args, engine_kwargs
from encore.engine.config import EngineConfig

if TYPE_CHECKING:  # torch and the engine are imported when a command runs, not with the CLI
    from encore.engine.model_runner import ModelRunner
    from encore.graphs.compiler import CompileRecord
    from encore.graphs.keys import GraphKey
    from encore.graphs.runner import KeyReport


class Progress:
    """``key N/M <key> compile|load|run Xs capture Ys | elapsed | ETA``, one line per key (redrawn in
    place on a terminal), for ``keys`` in the order they are prepared. The ETA charges each family not
    yet compiled (or loaded) the mean of the families' first keys so far and each other remaining key
    the mean of the keys that only ran (the first key's cost until one has)."""

    def __init__(self, keys: tuple[GraphKey, ...], out: TextIO) -> None:
        self.keys = keys
        self.out = out
        self.start = time.perf_counter()
        self.tty = out.isatty()
        self.compile_s: list[float] = []  # first-call + capture seconds of keys that compiled or loaded a graph
        self.run_s: list[float] = []  # the same, of keys that only ran their family's graph

    def __call__(self, index: int, report: KeyReport) -> None:
        done, total = index + 1, len(self.keys)
        elapsed = time.perf_counter() - self.start
        (self.compile_s if report.built else self.run_s).append(report.compile_s + report.capture_s)
        compiled = {k.mode for k in self.keys[:done]}
        new_families = len({k.mode for k in self.keys[done:]} - compiled)
        mean_compile = sum(self.compile_s) / len(self.compile_s) if self.compile_s else 0.0
        mean_run = sum(self.run_s) / len(self.run_s) if self.run_s else mean_compile
        eta = new_families * mean_compile + (total - done - new_families) * mean_run
        width = 24
        filled = width * done // total
        line = (f"[{'#' * filled}{'.' * (width - filled)}] key {done}/{total} {report.key} "
                f"{report.first_call} {report.compile_s:.1f}s "
                f"capture {report.capture_s:.2f}s | elapsed {_clock(elapsed)} | ETA {_clock(eta)}")
        end = "\n" if not self.tty or done == total else ""
        self.out.write(("\r\x1b[2K" if self.tty else "") + line + end)
        self.out.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s"


def warmup(model: str | Path, device: str = "cuda", cache_dir: str | Path | None = None, progress: bool = True,
           out: TextIO | None = None, **engine_options) -> dict:
    """Compiles every graph family of ``model`` and runs (on CUDA captures) every graph key under the
    graph cache, and the model drafter's graph of a speculative method that has one; returns the
    manifest written. ``engine_options`` are EngineConfig fields (dtype,
    page_size, graph sizes…): pass the ones the server will use, since they pick the cache."""
    from encore.engine.model_runner import ModelRunner
    from encore.models.config import ModelConfig

    out = out if out is not None else sys.stderr
    start = time.perf_counter()
    engine_options.setdefault("compile", True)
    config = EngineConfig(model=str(model), device=device, graph_cache_dir=str(cache_dir) if cache_dir else None,
                          **engine_options)
    if not (config.use_compile or config.use_cuda_graphs):
        raise ValueError("warmup needs compile=True or cuda_graphs=True; both are off")
    model_config = ModelConfig.from_pretrained(model)
    runner = ModelRunner(config, model_config, config.max_model_len or model_config.max_position_embeddings)
    if runner.graphs is None:
        raise ValueError("no graph key fits max_num_batched_tokens / max_num_seqs; nothing to warm up")
    bar = Progress(runner.graphs.keys, out) if progress else None
    runner.prepare_graphs(on_key=bar, rewrite_manifest=True)
    drafter = _prepare_drafter(config, runner, model_config.vocab_size)
    if progress and drafter is not None:
        out.write(f"drafter graph {'loaded' if drafter.loaded else 'compiled'} in {drafter.seconds:.1f}s\n")
    manifest = json.loads(runner.graph_cache.manifest_path.read_text())
    if progress:
        out.write(f"warm-up done in {_clock(time.perf_counter() - start)}: {len(manifest['keys'])} keys, "
                  f"{sum(f['graphs_compiled'] for f in manifest['families'].values())} graphs compiled, graph pool "
                  f"{manifest['graph_pool_bytes'] / 2**20:.1f} MiB, cache {runner.graph_cache.root}\n")
    return manifest


def _prepare_drafter(config: EngineConfig, runner: ModelRunner, vocab_size: int) -> CompileRecord | None:
    """A model drafter's compiled graph (MTP, EAGLE-3), built as an engine start builds it (its
    speculator compiles it into the graph cache and captures its CUDA graphs); its CompileRecord, or
    None where the engine would compile none (no model drafter, or no compiled CUDA graphs)."""
    if config.speculative is None:
        return None
    from encore.engine.spec.speculator import Speculator

    compiled = Speculator(config.speculative, runner, vocab_size).compiled_drafter
    return compiled.record if compiled is not None else None


def list_manifest(cache_dir: str | Path | None = None, out: TextIO | None = None) -> list[dict]:
    """Prints every manifest under the cache root (one block per model + configuration); returns them.
    An unreadable manifest is reported, not raised: ``warmup`` or an engine start rebuilds it."""
    from encore.graphs.cache import MANIFEST_FORMAT, default_cache_root

    out = out if out is not None else sys.stdout
    root = Path(cache_dir) if cache_dir else default_cache_root()
    manifests = []
    for path in sorted(root.glob("*/manifest.json")):
        try:
            manifest = json.loads(path.read_text())
            if manifest.get("format") != MANIFEST_FORMAT:
                out.write(f"{path.parent}: manifest format {manifest.get('format')!r}; it will be rebuilt\n")
                continue
            keys, ident, families = manifest["keys"], manifest["identity"], manifest["families"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            out.write(f"{path.parent}: unreadable manifest ({exc}); it will be rebuilt\n")
            continue
        manifests.append(manifest)
        arch = ident.get("model_config", {}).get("architecture", "?")
        versions = ", ".join(f"{k} {v}" for k, v in ident.get("versions", {}).items())
        out.write(f"{path.parent.name}  {arch}  {ident.get('device')}  dtype={ident.get('dtype')}  "
                  f"created {manifest.get('created')}  ({versions})\n")
        out.write(f"  {'mode':<7} {'extends':>7} {'q_len':>5} {'bs':>5} {'tokens':>6} {'graphs':>6} {'loaded':>6} "
                  f"{'first_s':>8} {'capture_s':>9} {'pool_MiB':>8}\n")
        for k in keys:
            out.write(f"  {k['mode']:<7} {k['num_extends']:>7} {k['q_len_per_req']:>5} {k['bs']:>5} "
                      f"{k['num_tokens']:>6} {k['graphs_compiled']:>6} {k['graphs_loaded']:>6} {k['compile_s']:>8.2f} "
                      f"{k['capture_s']:>9.3f} {k['pool_bytes'] / 2**20:>8.1f}\n")
        for mode, family in families.items():
            out.write(f"  family {mode}: {family['keys']} keys, {family['graphs_compiled']} graph(s) compiled, "
                      f"{family['graphs_loaded']} loaded precompiled, {family['compile_s']:.1f}s to compile or "
                      f"load, {family['run_s']:.1f}s to run the other keys\n")
        drafter = ident.get("drafter")
        if drafter:
            state = ("graph precompiled" if (path.parent / "precompiled" / "drafter.aot").exists() else
                     "no precompiled graph (an engine start with CUDA graphs builds one)")
            out.write(f"  drafter {drafter['method']}: {state}\n")
        out.write(f"  {len(keys)} keys, {manifest.get('total_s', 0):.1f}s, graph pool "
                  f"{manifest.get('graph_pool_bytes', 0) / 2**20:.1f} MiB\n")
    if not manifests:
        out.write(f"no graph cache manifests under {root}\n")
    return manifests


def add_graphs_subcommands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``graphs warmup`` and ``graphs list`` to a CLI's subparsers; each sets ``run``."""
    graphs = subparsers.add_parser("graphs", help="compiled graphs: warm-up and cache listing")
    commands = graphs.add_subparsers(dest="graphs_command", required=True)

    warm = commands.add_parser("warmup", help="compile and capture every graph key, persist the compile caches",
                               description="Builds the graph cache of a model and the engine options given: pass "
                                           "the options the server will run with (encore serve's engine options), "
                                           "since they pick the cache and its keys.")
    add_engine_args(warm, device="cuda")
    warm.set_defaults(run=_warmup_command)

    listing = commands.add_parser("list", help="print the graph cache manifests")
    listing.add_argument("--cache-dir", default=None)
    listing.set_defaults(run=lambda args: 0 if list_manifest(args.cache_dir) is not None else 1)
    return graphs


def _warmup_command(args: argparse.Namespace) -> int:
    options = engine_kwargs(args)
    warmup(cache_dir=options.pop("graph_cache_dir", None), **options)
    return 0
