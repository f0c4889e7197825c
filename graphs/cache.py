"""The graph cache: compile artifacts and the warm-up manifest of one model + configuration.

Layout, under ``graph_cache_dir`` (default ``$XDG_CACHE_HOME/encore/graphs``)::

    <identity hash>/manifest.json    keys with first-call / capture times, graphs compiled and graph-pool
                                     growth, and a summary per graph family
    <identity hash>/inductor/        Inductor's caches (FX graphs, AOTAutograd, generated kernels; their
                                     Triton binaries in Triton's own cache, ``model_runner.triton_as_every_start``)
    <identity hash>/precompiled/     one precompiled graph per family (graphs/compiler.py), for any KV
                                     pool size (``GraphCache.precompiled_dir``)
    flashinfer/                      flashinfer's JIT builds, when flashinfer is installed and
                                     FLASHINFER_WORKSPACE_BASE is not set (``GraphCache.active``)

The identity is everything a compiled graph depends on: the model config, the engine settings that
shape a graph (dtype, page size, backend, the keys), the encore / torch / triton / Python versions
and GPU, a digest of encore's own sources (a precompiled graph holds dynamo's bytecode of the model
and the passes' output, so the cache must not outlive an edit to either), and a digest of Inductor's
settings (``TORCHINDUCTOR_*`` variables among them: a precompiled graph is Inductor's output, which a
change of them would not otherwise rebuild). A different identity
is a different directory. Within one, a manifest that cannot be read, names another identity, or
points at artifacts that are gone is stale or corrupt: the directory is deleted with a warning and
rebuilt, never used. Inductor keys its own entries by graph and version too, so the manifest check
guards encore's records, not the safety of a cache hit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from encore.graphs.keys import keys_for

if TYPE_CHECKING:  # encore.engine imports this module: only the annotations need these
    from encore.engine.config import EngineConfig
    from encore.models.config import ModelConfig

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 3  # 2: one compiled graph per family (graphs/compiler.py), counted per key; 3: and loaded


def default_cache_root() -> Path:
    """The one place the cache location is read from the environment."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "encore" / "graphs"


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def source_digest() -> str:
    """A digest of every Python source of encore's packages that can shape a compiled graph."""
    import importlib

    digest = hashlib.sha256()
    for package in ("models", "backends", "passes", "graphs", "engine"):
        root = Path(importlib.import_module(f"encore.{package}").__path__[0])
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{package}/{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def identity(config: EngineConfig, model_config: ModelConfig, drafter: dict | None = None) -> dict:
    """``drafter``: the model drafter whose graph the cache also holds (its method, and an EAGLE-3 draft
    model's config), None without one."""
    keys = keys_for(config)
    device = torch.device(config.device)
    return {
        "model_config": asdict(model_config),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "dtype": config.dtype,
        "page_size": config.page_size,
        "attention_backend": config.attention_backend,
        "compile": config.use_compile,
        "cuda_graphs": config.use_cuda_graphs,
        "keys": [[k.num_extends, k.q_len_per_req, k.bs, k.num_tokens] for k in keys],
        "drafter": drafter,
        "versions": {"encore": _version("encore"), "torch": torch.__version__, "triton": _version("triton"),
                     "python": platform.python_version()},
        "encore_source": source_digest(),
        "inductor_config": inductor_config_digest() if config.use_compile else None,
    }


def inductor_config_digest() -> str:
    """A digest of Inductor's settings as its own FX-graph cache keys them (``save_config_portable``: no
    paths, thread counts or other per-machine values)."""
    from torch._inductor import config as inductor_config

    settings = json.dumps(inductor_config.save_config_portable(), sort_keys=True, default=repr)
    return hashlib.sha256(settings.encode()).hexdigest()[:16]


def _digest(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _families(reports: list) -> dict[str, dict]:
    """Per family (mode): its keys, the graphs they compiled or loaded precompiled, and their
    first-call seconds, those of the keys that compiled (or loaded) a graph apart from those that
    only ran it."""
    families: dict[str, dict] = {}
    for r in reports:
        family = families.setdefault(r.key.mode.value,
                                     {"keys": 0, "graphs_compiled": 0, "graphs_loaded": 0, "compile_s": 0.0,
                                      "run_s": 0.0})
        family["keys"] += 1
        family["graphs_compiled"] += r.graphs_compiled
        family["graphs_loaded"] += r.graphs_loaded
        family["compile_s" if r.built else "run_s"] += r.compile_s
    for family in families.values():
        family["compile_s"], family["run_s"] = round(family["compile_s"], 3), round(family["run_s"], 3)
    return families


@dataclass(frozen=True, slots=True)
class GraphCache:
    root: Path
    ident: dict

    @staticmethod
    def for_engine(config: EngineConfig, model_config: ModelConfig, drafter: dict | None = None) -> GraphCache:
        ident = identity(config, model_config, drafter)
        base = Path(config.graph_cache_dir) if config.graph_cache_dir else default_cache_root()
        return GraphCache(base / _digest(ident), ident)

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    @property
    def inductor_dir(self) -> Path:
        return self.root / "inductor"

    @property
    def precompiled_dir(self) -> Path:
        """One for every KV pool size: an engine sizes its pool from the memory free at start-up, so the
        pool's page count is a symbol of the compiled graphs, not a guarded constant (model_runner marks
        it dynamic). When it was guarded, a start with one page more or less than the cache's (a few MB
        of free memory) compiled every family again: 204 s for V2-Lite on an H200 (session 38)."""
        return self.root / "precompiled"

    @property
    def drafter_artifact(self) -> Path:
        """The model drafter's precompiled graph (graphs/compiler.py ``CompiledDrafter``)."""
        return self.precompiled_dir / "drafter.aot"

    def read_manifest(self) -> dict | None:
        """The manifest if it is present and sound; None if absent. A stale or corrupt cache is
        deleted (with a warning), then None."""
        if not self.manifest_path.exists():
            return None
        problem = None
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (OSError, ValueError) as exc:
            problem, manifest = f"unreadable manifest ({exc})", None
        if manifest is not None:
            if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
                problem = f"manifest format {manifest.get('format') if isinstance(manifest, dict) else None!r}"
            elif manifest.get("identity_hash") != _digest(self.ident) or manifest.get("identity") != json.loads(
                    json.dumps(self.ident, default=str)):
                problem = "manifest written for another model, configuration or version"
            elif not self.inductor_dir.is_dir() or not any(self.inductor_dir.iterdir()):
                problem = "compile artifacts are missing"
        if problem is None:
            return manifest
        log.warning("graph cache %s is stale or corrupt (%s): deleting it and rebuilding", self.root, problem)
        shutil.rmtree(self.root, ignore_errors=True)
        return None

    @property
    def flashinfer_dir(self) -> Path:
        """flashinfer's JIT builds: one directory beside the identities, which all share it. flashinfer
        keys a build on its own version and the GPU architecture and rebuilds a module whose sources or
        flags changed (ninja), so nothing of encore's identity shapes it. Kept in the identity's
        directory, they were built again for every new identity (any other graph key, page size or
        encore version): 69 s of a cold V2-Lite start on an H200 (session 33)."""
        return self.root.parent / "flashinfer"

    @contextmanager
    def active(self) -> Iterator[GraphCache]:
        """Compiles inside this block read and write this cache: Inductor's cache directory is pointed
        here for the duration, and flashinfer's JIT directory at ``flashinfer_dir`` unless
        FLASHINFER_WORKSPACE_BASE is set (flashinfer resolves it when first imported, so a flashinfer
        backend must import it lazily, inside the warm-up)."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        self.inductor_dir.mkdir(parents=True, exist_ok=True)
        ours = "FLASHINFER_WORKSPACE_BASE" not in os.environ
        if ours:
            os.environ["FLASHINFER_WORKSPACE_BASE"] = str(self.flashinfer_dir)
        try:
            with temporary_cache_dir(str(self.inductor_dir)):
                yield self
        finally:
            if ours:
                os.environ.pop("FLASHINFER_WORKSPACE_BASE", None)

    def write_manifest(self, reports: list) -> dict:
        """Records ``reports`` (graphs.runner.KeyReport, one per key) as this cache's manifest. A key's
        ``compile_s`` is its first call: its family's compile on the family's first key, a plain run on
        the rest; ``families`` splits each family's time so."""
        manifest = {
            "format": MANIFEST_FORMAT,
            "identity_hash": _digest(self.ident),
            "identity": json.loads(json.dumps(self.ident, default=str)),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "total_s": round(sum(r.compile_s + r.capture_s for r in reports), 3),
            "graph_pool_bytes": sum(r.pool_bytes for r in reports),
            "keys": [{"mode": r.key.mode.value, "num_extends": r.key.num_extends,
                      "q_len_per_req": r.key.q_len_per_req, "bs": r.key.bs, "num_tokens": r.key.num_tokens,
                      "graphs_compiled": r.graphs_compiled, "graphs_loaded": r.graphs_loaded,
                      "compile_s": round(r.compile_s, 3),
                      "capture_s": round(r.capture_s, 3), "pool_bytes": r.pool_bytes} for r in reports],
            "families": _families(reports),
        }
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(self.manifest_path)  # atomic: a killed warm-up never leaves half a manifest
        return manifest
