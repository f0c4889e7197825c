"""Tile sweep of the Triton MLA prefill kernel, to choose ``default_prefill_config`` (backends/triton_mla_prefill.py).

For float32 (the exact ``ieee`` dot) and bf16, every KernelConfig of a fixed list runs ragged causal
prefills of two head shapes: encore-tiny's (H 4, D 96 = 64 + 32, Dv 32) and, in bf16, DeepSeek-V2-Lite's
(H 16, D 192, Dv 128), with many short rows (20 tokens, each row's table 2048 keys wide, as the
Triton backend hands the kernel) and a few long ones. Each config runs in its own process (a launch
that faults poisons its CUDA context, and the sweep goes on) and is checked against float32 SDPA
(max |diff| / max |ref| over the first rows), then timed by replaying a CUDA graph of ten back-to-back
calls (median of ten replays, per call; ``tune_mla_decode.graph_us``).

    python benchmarks/tune_mla_prefill.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CONFIGS = [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 1), (32, 64, 4, 2), (32, 32, 4, 1),
           (32, 32, 2, 1), (16, 32, 4, 2), (16, 64, 4, 2), (16, 16, 2, 1)]  # block_m, block_n, warps, stages
TINY, LITE = (4, 96, 32), (16, 192, 128)  # heads, qk dim, v dim
CASES = {  # name: (shape, rows, new tokens per row, keys per row, dtypes)
    "tiny 16x20": (TINY, 16, 20, 2048, ("float32", "bfloat16")),
    "tiny 64x20": (TINY, 64, 20, 2048, ("float32", "bfloat16")),
    "tiny 2x500": (TINY, 2, 500, 512, ("float32", "bfloat16")),
    "lite 64x20": (LITE, 64, 20, 2048, ("bfloat16",)),
    "lite 4x1000": (LITE, 4, 1000, 1024, ("bfloat16",)),
    "lite 1x4000": (LITE, 1, 4000, 4096, ("bfloat16",)),
}


def run_case(dtype, config, shape: tuple[int, int, int], rows: int, q_len: int, span: int) -> dict:
    import torch
    from tune_mla_decode import graph_us, max_rel_err

    from encore.backends.triton_mla_prefill import mla_prefill

    heads, dim, dim_v = shape
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(rows * q_len, heads, dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(rows * span, heads, dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(rows * span, heads, dim_v, device="cuda", dtype=dtype, generator=gen)
    qo = torch.arange(rows + 1, device="cuda", dtype=torch.int32) * q_len
    kv = torch.arange(rows + 1, device="cuda", dtype=torch.int32) * span
    prefix = torch.zeros(rows, device="cuda", dtype=torch.int32)
    out = torch.zeros(rows * q_len, heads, dim_v, device="cuda", dtype=dtype)

    def call():
        mla_prefill(q, k, v, qo, kv, prefix, dim ** -0.5, out, config=config)

    call()  # compiles the variant, outside the capture
    err = 0.0
    for r in range(min(rows, 4)):  # prefix 0: row r's queries see its first q_len keys, causally
        rq, rk = slice(r * q_len, (r + 1) * q_len), slice(r * span, r * span + q_len)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[rq].float().transpose(0, 1), k[rk].float().transpose(0, 1), v[rk].float().transpose(0, 1),
            is_causal=True, scale=dim ** -0.5).transpose(0, 1)
        err = max(err, max_rel_err(out[rq], ref))
    return {"us": graph_us(call, calls=10, iters=10), "rel_err": err}


def child(dtype_name: str, config: list[int]) -> None:
    import torch

    from encore.backends.triton_common import KernelConfig

    dtype, cfg = getattr(torch, dtype_name), KernelConfig(*config)
    results = {name: run_case(dtype, cfg, shape, rows, q_len, span)
               for name, (shape, rows, q_len, span, dtypes) in CASES.items() if dtype_name in dtypes}
    print(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)  # dtype block_m block_n warps stages
    args = ap.parse_args()
    if args.child:
        child(args.child[0], [int(x) for x in args.child[1:]])
        return
    from encore.backends.triton_mla_prefill import default_prefill_config
    import torch

    rows = []
    for dtype in ("float32", "bfloat16"):
        default = default_prefill_config(getattr(torch, dtype))
        for config in CONFIGS:
            run = subprocess.run([sys.executable, __file__, "--child", dtype, *map(str, config)],
                                 capture_output=True, text=True)
            lines = run.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if run.returncode == 0 and lines else None
            error = None if result is not None else (run.stderr.strip().splitlines() or ["no output"])[-1][:200]
            is_default = config == (default.block_m, default.block_n, default.num_warps, default.num_stages)
            rows.append({"dtype": dtype, "config": config, "default": is_default, "cases": result, "error": error})
            cells = (" ".join(f"{name} {r['us']:7.1f}" for name, r in result.items()) if result
                     else f"FAILED: {error}")
            print(f"{dtype:9} {str(config):16} {'default' if is_default else '':7} {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
