"""model_runner.same_ptxas_as_inductor: an engine's Triton kernels are keyed on torch's ptxas from its
first compile on, whatever compiles first, so a warm start finds the kernels a cold start cached."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from encore.engine.model_runner import same_ptxas_as_inductor

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_only_a_cuda_engine_sets_the_ptxas(monkeypatch):
    import torch._inductor.runtime.compile_tasks as compile_tasks

    calls = []
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: calls.append(1))
    same_ptxas_as_inductor(torch.device("cpu"))
    assert calls == []
    same_ptxas_as_inductor(torch.device("cuda", 0))
    assert calls == [1]


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
