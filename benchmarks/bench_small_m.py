"""Dense projections of one to four tokens on the GPU: cuBLAS (``torch.mm``) against encore's Triton
GEMV (``gemv_triton.gemv``, the kernel behind ``encore::dense``), launched as a programmatic dependent
(PDL: its weight read overlaps the kernel before it) and plainly.

Each variant is timed as a CUDA graph of back-to-back calls, the way a decode step's graph runs them:
every call reads its own copy of the weight (the copies together are several times the L2, so every
call reads from HBM) and writes a fresh output. µs per call; floor = weight bytes / copy bandwidth
(read + write) of a large ``copy_`` replayed in a CUDA graph, measured after the timings in the same
run (a graph's copy measures lower than an eager one, so this floor is loose; the measurement is the
ratio to cuBLAS). Shapes: DeepSeek-V2-Lite's fused
q/kv_a projection, o_proj, router (float32 logits), LM head and dense MLP (layer 0), and V3's
q_a/kv_a, q_b, o_proj, router, LM head and dense MLP's gate_up (its down's K is past the GEMV's).

    python benchmarks/bench_small_m.py [--tokens 1 2 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench_mla_decode import copy_bandwidth, graph_time_us
from encore.backends.gemv_triton import gemv

SHAPES = {  # name -> (N, K, float32 out)
    "v2-lite q/kv_a": (3072 + 576, 2048, False),
    "v2-lite o_proj": (2048, 2048, False),
    "v2-lite router": (64, 2048, True),
    "v2-lite lm_head": (102400, 2048, False),
    "v2-lite dense gate_up": (2 * 10944, 2048, False),
    "v2-lite dense down": (2048, 10944, False),
    "v3 q_a/kv_a": (1536 + 576, 7168, False),
    "v3 q_b": (128 * 192, 1536, False),
    "v3 o_proj": (7168, 128 * 128, False),
    "v3 router": (256, 7168, True),
    "v3 lm_head": (129280, 7168, False),
    "v3 dense gate_up": (2 * 18432, 7168, False),
}
COPY_BYTES = 512 << 20  # weight copies per shape: at least this much, several times the L2
CALLS = 24
DEFAULT_JSON = Path(__file__).parent / "results" / "bench_small_m.json"


def cublas(x: torch.Tensor, w: torch.Tensor, fp32_out: bool) -> torch.Tensor:
    return torch.mm(x, w.t(), out_dtype=torch.float32) if fp32_out else torch.mm(x, w.t())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    rows = []
    for name, (n, k, fp32_out) in SHAPES.items():
        weight_bytes = n * k * 2
        copies = max(2, -(-COPY_BYTES // weight_bytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        out_dtype = torch.float32 if fp32_out else None
        for tokens in args.tokens:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().t()
            err = (gemv(x, ws[0], out_dtype).float() - ref).norm() / ref.norm()
            assert err < 1e-2, f"{name}, {tokens} tokens: GEMV relative error {err:.2e}"
            us = {}
            for variant, call in (("cublas", lambda w: cublas(x, w, fp32_out)),
                                  ("gemv", lambda w: gemv(x, w, out_dtype, pdl=False)),
                                  ("gemv_pdl", lambda w: gemv(x, w, out_dtype))):
                us[variant] = graph_time_us([lambda c=c: call(ws[c % copies]) for c in range(CALLS)])
            rows.append({"shape": name, "n": n, "k": k, "tokens": tokens, "weight_bytes": weight_bytes, **us})
        del ws
        torch.cuda.empty_cache()
    bandwidth = copy_bandwidth()  # after the timings: a GPU that just started measures low
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; µs per call")
    print("| shape | N × K | tokens | floor µs | cuBLAS µs | GEMV µs | GEMV + PDL µs | GEMV + PDL / cuBLAS |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        row["floor_us"] = row["weight_bytes"] / bandwidth * 1e6
        print(f"| {row['shape']} | {row['n']} × {row['k']} | {row['tokens']} | {row['floor_us']:.2f} | "
              f"{row['cublas']:.2f} | {row['gemv']:.2f} | {row['gemv_pdl']:.2f} | "
              f"{row['gemv_pdl'] / row['cublas']:.2f} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "copy_bandwidth_Bps": bandwidth, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
