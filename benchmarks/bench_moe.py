"""Routed-expert time of one DeepSeek-V2-Lite MoE layer on the GPU (E 64, top-6, H 2048, I 1408, bf16).
With ``--shared 2`` (V2-Lite's shared experts), each token's last two pairs are experts 64 and 65 at
weight 1, as the engine fuses them on CUDA (``moe.with_shared_experts``).

For each token count: the Triton fused MoE (``moe_triton.fused_moe``) and ``experts_grouped`` (sort +
two ``torch._grouped_mm``), each timed by replaying a CUDA graph of back-to-back calls on the same
routing. Floor: the bytes of the distinct experts' weights the routing touches, plus x and the
output, over the device-copy bandwidth (read + write) of a large ``copy_`` measured in the same run.
The kernels only read their weights, and reads alone run faster than a copy, so a tighter "read
floor" over the bandwidth of a large sum (read only) is printed beside it.
The calls of one graph cycle through copies of the layer, together many times the L2, so every call
reads its experts from HBM as a model step does (the other layers' weights evict them in between).

    python benchmarks/bench_moe.py [--tokens 1 2 4 ...] [--shared 0] [--json PATH] [--sweep [--sweep-tokens 64 256]]

Decode goals: T = 1 within 1.15x the floor, T = 64 at least 0.8x the floor's throughput. ``--sweep``
also times a grid of ``FusedMoEConfig`` per token count and prints the best, to retune
``moe_triton._CONFIGS`` (block_m too: the pairs an expert gets set how much a block's weight tile is
reused); where the fused MoE stops beating ``experts_grouped`` sets ``moe.FUSED_MOE_MAX_PAIRS``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench_mla_decode import copy_bandwidth, graph_time_us, rel_diff
from encore.backends.moe import FUSED_MOE_MAX_PAIRS, experts_grouped
from encore.backends.moe_triton import (
    ONE_TOKEN, FusedMoEConfig, OneTokenConfig, default_config, fused_moe, one_token_moe)

EXPERTS, TOP_K, HIDDEN, INTER = 64, 6, 2048, 1408
COPIES = 3  # 3.3 GB of layers: a call's experts were evicted by the two calls before it
CALLS = 12  # per graph: four rounds of the copies
GOALS = {1: 1.15, 64: 1 / 0.8}  # tokens -> most time allowed, in floors
DEFAULT_JSON = Path(__file__).parent / "results" / "bench_moe.json"


class Case:
    """One routing of ``tokens`` tokens over the layer copies (w13s, w2s: COPIES each, EXPERTS + shared
    experts), the ``shared`` experts last in every token's pairs at weight 1."""

    def __init__(self, tokens: int, w13s: list[torch.Tensor], w2s: list[torch.Tensor], shared: int) -> None:
        self.w13s, self.w2s, self.shared = w13s, w2s, shared
        self.x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        routed = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices  # [T, k]
        fused = torch.arange(EXPERTS, EXPERTS + shared, device="cuda").expand(tokens, shared)
        self.ids = torch.cat([routed, fused], dim=1).contiguous()
        self.weights = torch.cat([torch.rand(tokens, TOP_K, device="cuda"),
                                  torch.ones(tokens, shared, device="cuda")], dim=1).contiguous()
        self.touched = self.ids.unique().numel()
        self.bytes = self.touched * 3 * INTER * HIDDEN * 2 + 2 * self.x.numel() * 2  # experts, x, out

    def calls(self, experts, **kwargs):
        return [lambda c=c: experts(self.x, self.w13s[c % COPIES], self.w2s[c % COPIES], self.weights, self.ids,
                                    **kwargs) for c in range(CALLS)]

    def fused(self, config: FusedMoEConfig | OneTokenConfig | None = None):
        run = one_token_moe if isinstance(config, OneTokenConfig) else fused_moe
        return self.calls(run, num_shared=self.shared, config=config)

    def last(self, experts) -> torch.Tensor:
        return self.calls(experts)[-1]()


def read_bandwidth() -> float:
    """Bytes per second read by a float32 sum over 4 GiB of bf16."""
    data = torch.randn(2 << 30, device="cuda", dtype=torch.bfloat16)
    return data.numel() * 2 / (graph_time_us([lambda: data.sum(dtype=torch.float32)] * 4) * 1e-6)


def sweep_configs(tokens: int):
    if tokens == 1:  # fused_moe's path for one token: the one-token kernels
        for gate_n, down_n, warps in itertools.product((1, 2, 4), (1, 2, 4, 8), (2, 4, 8)):
            yield OneTokenConfig(gate_n, down_n, warps)
        return
    for block_m, block_n, block_k, warps, stages in itertools.product((16, 32, 64), (64, 128), (64, 128), (2, 4, 8),
                                                                      (3,)):
        yield FusedMoEConfig(block_m, block_n, block_k, warps, stages)


def measure(case: Case, bandwidth: float, read: float, sweep: bool) -> dict:
    tokens = case.x.shape[0]
    row = {"tokens": tokens, "pairs": case.ids.numel(), "experts_touched": case.touched, "bytes": case.bytes,
           "floor_us": round(case.bytes / bandwidth * 1e6, 2), "read_floor_us": round(case.bytes / read * 1e6, 2),
           "fused_us": round(graph_time_us(case.fused()), 2),
           "grouped_us": round(graph_time_us(case.calls(experts_grouped)), 2),
           "rel_diff_fused_vs_grouped": round(rel_diff(case.fused()[-1](), case.last(experts_grouped)), 5)}
    if sweep:
        best = (row["fused_us"], str(ONE_TOKEN if tokens == 1 else default_config(tokens, torch.bfloat16)))
        for config in sweep_configs(tokens):
            try:
                best = min(best, (graph_time_us(case.fused(config=config)), str(config)))
            except Exception as exc:  # a tile set past the shared memory: report, keep sweeping
                if "OutOfResources" not in type(exc).__name__:
                    raise
        row["sweep_best_us"], row["sweep_best"] = round(best[0], 2), best[1]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--shared", type=int, default=0, help="shared experts fused as the last pairs of every token")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-tokens", type=int, nargs="+", help="sweep only these token counts (default: all)")
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    args = ap.parse_args()
    torch.manual_seed(0)
    bandwidth, read = copy_bandwidth(), read_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write), read "
          f"{read / 1e9:.0f} GB/s; FUSED_MOE_MAX_PAIRS {FUSED_MOE_MAX_PAIRS}")
    stacked = EXPERTS + args.shared
    w13s = [torch.randn(stacked, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
            for _ in range(COPIES)]
    w2s = [torch.randn(stacked, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * INTER ** -0.5
           for _ in range(COPIES)]
    rows = [measure(Case(tokens, w13s, w2s, args.shared), bandwidth, read,
                    args.sweep and (args.sweep_tokens is None or tokens in args.sweep_tokens))
            for tokens in args.tokens]
    print(f"{'T':>5} {'pairs':>6} {'experts':>7} {'floor µs':>9} {'read µs':>8} {'fused µs':>9} {'x floor':>8} "
          f"{'x read':>7} {'grouped µs':>11} {'x floor':>8} {'rel diff':>9}" + ("  sweep best" if args.sweep else ""))
    for r in rows:
        line = (f"{r['tokens']:>5} {r['pairs']:>6} {r['experts_touched']:>7} {r['floor_us']:>9} "
                f"{r['read_floor_us']:>8} {r['fused_us']:>9} {r['fused_us'] / r['floor_us']:>8.2f} "
                f"{r['fused_us'] / r['read_floor_us']:>7.2f} "
                f"{r['grouped_us']:>11} {r['grouped_us'] / r['floor_us']:>8.2f} {r['rel_diff_fused_vs_grouped']:>9}")
        if "sweep_best" in r:
            line += f"  {r['sweep_best_us']} µs ({r['sweep_best']})"
        print(line)
    for r in rows:
        if r["tokens"] in GOALS:
            ratio, goal = r["fused_us"] / r["floor_us"], GOALS[r["tokens"]]
            print(f"goal T={r['tokens']}: fused {ratio:.2f}x floor, allowed {goal:.2f}x: "
                  f"{'met' if ratio <= goal else 'NOT met'} ({r['fused_us'] / r['read_floor_us']:.2f}x the read floor)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
                   "read_bandwidth_GBps": round(read / 1e9, 1),
                   "fused_moe_max_pairs": FUSED_MOE_MAX_PAIRS, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
