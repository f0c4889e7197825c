"""Triton's interpreter for the CPU tests of encore's kernels; import it before anything that imports triton.

Without CUDA the kernels run in Triton's interpreter (numpy on CPU tensors). TRITON_INTERPRET must be
set before triton is first imported (triton's own library functions are decorated then); it only
changes how Triton kernels launch, and a CPU-only process cannot launch compiled ones anyway, so
leaving it set for the rest of the session harms no other test. If another module imported triton
first (torch._inductor does), this process cannot switch: ``TOO_LATE`` is then true, the CPU tests
marked ``in_process`` skip, and the test ``rerun_in_child`` makes runs the module again in a child
process that sets it. The interpreter's bfloat16 tl.dot is wrong in triton 3.9 (it multiplies the raw
bits), so CPU tests use float32 and float16; the GPU tests (``-m gpu``) cover bfloat16.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TOO_LATE = (not torch.cuda.is_available() and "triton" in sys.modules
            and os.environ.get("TRITON_INTERPRET") != "1")
if not torch.cuda.is_available() and not TOO_LATE:
    os.environ["TRITON_INTERPRET"] = "1"

in_process = pytest.mark.skipif(TOO_LATE, reason="triton was imported before the interpreter was enabled; "
                                "test_cpu_tests_in_child_process runs these")


def rerun_in_child(test_file: str):
    """The module's ``test_cpu_tests_in_child_process``: its tests under the interpreter in a child
    process, when this one imported triton too early to run them itself."""

    @pytest.mark.skipif(not TOO_LATE, reason="the CPU tests ran in this process")
    def test_cpu_tests_in_child_process():
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                               env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
        assert child.returncode == 0, child.stdout[-5000:] + child.stderr[-2000:]

    return test_cpu_tests_in_child_process
