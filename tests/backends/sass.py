"""sm90 SASS of an encore Triton kernel without a GPU: Triton's own ptxas and cuobjdump, for the tests'
child processes (gemv_sass.py, split_sass.py, moe_sass.py) that read what a kernel compiles to."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sass(fn, signature: dict[str, str], aligned: set[str], constants: dict, num_warps: int,
                 num_stages: int = 3) -> tuple[str, int]:
    """(SASS, registers a thread) of ``fn`` (a ``triton.jit`` function) for sm90: ``signature`` types its
    arguments in order, ``aligned`` names those a launch specializes as divisible by 16 (16-byte aligned
    pointers, strides that are multiples of 16), ``constants`` gives its constexprs."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(signature) if a in aligned}
    source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constants}}, constexprs=constants,
                       attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin.name], check=True,
                              capture_output=True, text=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin.name], check=True,
                               capture_output=True, text=True).stdout
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))
