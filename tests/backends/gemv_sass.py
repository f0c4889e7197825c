"""Compiles ``gemv_triton._gemv_kernel`` for sm90 (no GPU needed: Triton's own ptxas) at V2-Lite's q/kv_a
shape, one token, bf16, with ALIGN 1 and 8 and the norm on and off, and prints a JSON object: for each
"ALIGN,NORM" the SASS global-load instructions and their counts, and the registers a thread. Run in a
child process by test_gemv_triton.py: the CPU tests' interpreter mode cannot compile."""

from __future__ import annotations

import json
import re
import sys

from sass import compile_sass

from encore.backends.gemv_triton import _gemv_kernel

ARGS = ["X", "W", "OUT", "num_tokens", "n", "stride_xm", "stride_xg", "stride_wg", "stride_w", "stride_om",
        "stride_og", "DELTA", "NORM_W", "SUM", "NORMED", "stride_dm", "stride_sm", "stride_nm", "eps"]


def main() -> None:
    signature = {a: "*bf16" if a[0].isupper() else "fp32" if a == "eps" else "i32" for a in ARGS}
    # What a launch specializes: its pointers 16-byte aligned; the strides are not specialized on.
    aligned = {a for a in ARGS if a[0].isupper()}
    found = {}
    for align in (1, 8):
        for norm in (False, True):
            constants = dict(K=2048, BLOCK_N=8, BLOCK_K=2048, K_CONTIGUOUS=True, BLOCK_M=1, NORM=norm, ADD=norm,
                             STORE_NORMED=False, ALIGN=align, PDL=True)
            sass, registers = compile_sass(_gemv_kernel, signature, aligned, constants, num_warps=4)
            loads = re.findall(r"\bLDG\.E[.\w]*", sass)
            found[f"{align},{norm}"] = {"loads": {op: loads.count(op) for op in set(loads)}, "registers": registers}
    json.dump(found, sys.stdout)


if __name__ == "__main__":
    main()
