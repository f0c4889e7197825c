"""Compiles the one-token MoE kernels (``moe_triton._one_token_gate_up_kernel`` and
``_one_token_down_kernel``) for sm90 (no GPU needed: Triton's own ptxas) with ``one_token_moe``'s tiles,
bf16, at V2-Lite's layer (H 2048, I 1408, 6 routed + 2 shared pairs) and V3's (H 7168, I 2048, 8 + 1),
and prints a JSON object: for each "kernel,model" the registers a thread, its global loads by width,
its local-memory accesses (spills), its warp shuffles, and the 16-byte loads issued before its first
warp shuffle (the first reduction). Also the expert selection (``routing_triton._select_kernel``, one
warp) at V2-Lite's routing, as it is (no bias) and with a correction bias ("selection,v2-lite-bias").
Run in a child process by test_moe_triton.py: the CPU tests' interpreter mode cannot compile."""

from __future__ import annotations

import json
import re
import sys

import triton
from sass import compile_sass

from encore.backends.dense import GEMV_MAX_K
from encore.backends.moe_triton import ONE_TOKEN, _one_token_down_kernel, _one_token_gate_up_kernel
from encore.backends.routing_triton import _select_kernel

MODELS = {"v2-lite": (2048, 1408, 8, 2, 66), "v3": (7168, 2048, 9, 1, 257)}  # H, I, pairs, shared, experts


def report(sass: str, registers: int) -> dict:
    loads = re.findall(r"\bLDG\.E[.\w]*", sass)
    ops = re.findall(r"\b(LDG\.E\.128|SHFL\.BFLY)\b", sass)
    first_shuffle = ops.index("SHFL.BFLY") if "SHFL.BFLY" in ops else len(ops)
    return {"registers": registers, "loads": {op: loads.count(op) for op in set(loads)},
            "local": len(re.findall(r"\b(?:STL|LDL)\b", sass)), "shuffles": len(re.findall(r"\bSHFL\.", sass)),
            "vector_loads_before_reduction": first_shuffle}


def main() -> None:
    found = {}
    for model, (hidden, inter, pairs, shared, experts) in MODELS.items():
        block_h, block_i = triton.next_power_of_2(hidden), triton.next_power_of_2(inter)
        gate_n = max(1, min(ONE_TOKEN.gate_n, GEMV_MAX_K // (2 * block_h)))
        down_n = max(1, min(ONE_TOKEN.down_n, GEMV_MAX_K // block_i))
        sass, registers = compile_sass(
            _one_token_gate_up_kernel, {"X": "*bf16", "W13": "*bf16", "IDS": "*i64", "INTER": "*bf16"},
            {"X", "W13", "INTER"}, dict(H=hidden, I=inter, BLOCK_N=gate_n, BLOCK_K=block_h, PAIRS=pairs,
                                        ROUTED=pairs - shared, FIRST_SHARED=experts - shared, PDL=True),
            ONE_TOKEN.num_warps)
        found[f"gate_up,{model}"] = report(sass, registers)
        sass, registers = compile_sass(
            _one_token_down_kernel,
            {"INTER": "*bf16", "W2": "*bf16", "IDS": "*i64", "WEIGHTS": "*fp32", "OUT": "*bf16"},
            {"INTER", "W2", "WEIGHTS", "OUT"},
            dict(H=hidden, I=inter, BLOCK_N=down_n, BLOCK_K=block_i, PAIRS=pairs, PDL=True), ONE_TOKEN.num_warps)
        found[f"down,{model}"] = report(sass, registers) | {"tile_vector_loads": down_n * block_i * 2 // 16 // (
            32 * ONE_TOKEN.num_warps)}
    for name, bias in (("v2-lite", False), ("v2-lite-bias", True)):  # top-6 of 64 by softmax, 2 shared
        sass, registers = compile_sass(
            _select_kernel, {"LOGITS": "*fp32", "BIAS": "*fp32", "WEIGHTS": "*fp32", "IDS": "*i64", "scaling": "fp32"},
            {"LOGITS", "BIAS", "WEIGHTS", "IDS"},
            dict(E=64, BLOCK_E=64, TOP_K=6, BLOCK_K=8, SIGMOID=False, HAS_BIAS=bias, N_GROUP=1, BLOCK_G=2,
                 TOPK_GROUP=1, NOAUX_TC=False, RENORMALIZE=False, NUM_SHARED=2, PDL=True), 1)
        found[f"selection,{name}"] = report(sass, registers)
    json.dump(found, sys.stdout)


if __name__ == "__main__":
    main()
