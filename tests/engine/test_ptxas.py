"""model_runner.triton_as_every_start: an engine's Triton kernels are keyed on torch's ptxas from its
first compile on, whatever compiles first, and cached in one directory whatever Inductor does, so a
warm start finds the kernels a cold start cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from encore.engine.model_runner import triton_as_every_start

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_only_a_cuda_engine_sets_the_ptxas_and_pins_the_cache_directory_unless_set(monkeypatch, tmp_path):
    import torch._inductor.runtime.compile_tasks as compile_tasks
    import triton

    calls = []
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: calls.append(1))
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # recorded, so the variable is restored (here: removed) after
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    triton_as_every_start(torch.device("cpu"))
    assert calls == []
    assert "TRITON_CACHE_DIR" not in os.environ
    triton_as_every_start(torch.device("cuda", 0))
    assert calls == [1]
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / ".triton" / "cache") == triton.knobs.cache.dir
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    triton_as_every_start(torch.device("cuda", 0))
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


# A fresh process, and no graph compiled: Inductor never runs, so only the engine can have switched
# Triton to torch's ptxas before the kernel warm-up compiled the first Triton kernel of the process.
CHILD = r"""
import json, os
import torch
from triton.backends.nvidia.compiler import get_ptxas_version
from encore.engine import Engine

os.environ.pop("TRITON_PTXAS_PATH", None)
engine = Engine(device="cuda", num_kv_pages=256, compile=False, cuda_graphs=False)
major, minor = torch.cuda.get_device_capability()
print(json.dumps({"keyed_on": get_ptxas_version(10 * major + minor),
                  "ptxas_env": os.environ.get("TRITON_PTXAS_PATH")}))
"""


@pytest.mark.gpu
@needs_cuda
def test_kernels_are_keyed_on_torchs_ptxas_gpu():
    ptxas = Path(torch.__file__).parent / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip("this torch ships no ptxas of its own: Inductor and Triton use the same one")
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-5000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["ptxas_env"] == str(ptxas)
    assert got["keyed_on"] == subprocess.run([str(ptxas), "--version"], capture_output=True, text=True,
                                             check=True).stdout


# One start of a compiled, graph-capturing engine (a few keys) on the graph cache in argv[1].
START = r"""
import sys
from encore.engine import Engine

Engine(device="cuda", num_kv_pages=256, graph_cache_dir=sys.argv[1], graph_decode_sizes=(1, 2),
       graph_mixed_extends=(), graph_extend_sizes=(1,), graph_prefill_tokens=(128,))
"""


def cubins(root: Path) -> set[Path]:
    return set(root.rglob("*.cubin"))


@pytest.mark.gpu
@needs_cuda
def test_a_warm_start_compiles_no_triton_kernel_gpu(tmp_path):
    """A cold start (empty graph cache: Inductor compiles in its workers), then a warm one (Inductor
    loads its kernels in the engine's process): the warm start must find every Triton kernel, encore's
    kernel warm-up included, where the cold start cached it, and compile none. Triton's and the graph
    cache's directories both live under tmp_path, so a kernel compiled again anywhere shows."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    env["TRITON_HOME"] = str(tmp_path / "home")
    graphs = tmp_path / "graphs"
    for start in ("cold", "warm"):
        before = cubins(tmp_path)
        child = subprocess.run([sys.executable, "-c", START, str(graphs)], capture_output=True, text=True,
                               timeout=900, env=env)
        assert child.returncode == 0, (start, child.stderr[-5000:])
    assert before and cubins(tmp_path) == before, sorted(p.name for p in cubins(tmp_path) - before)
