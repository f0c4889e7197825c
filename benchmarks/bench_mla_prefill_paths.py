"""Each backend's two paths for an eager step's prefill rows, on DeepSeek-V2-Lite's attention dims
(H 16, qk 128 + 64, v 128, latent 512, bf16, pages of 64): MHA over the rows' decompressed KV against
absorbed MLA over the latent cache, each the peer of the other, in one run. flashinfer: MHA through
``BatchPrefillWithRaggedKVCacheWrapper``, absorbed through ``BatchMLAPagedAttentionWrapper`` (causal
rows). Triton: MHA through ``mla_prefill`` over each row's decompressed table span, absorbed through
``mla_decode`` with every new token a row of its own (the backend's static-step path). A layout is
rows × new tokens after a cached prefix; one layer's prefill op is timed with its plan (an eager step
plans every layer's attention once, before the forward: the plan is amortized over the layers, so
it is reported apart), CUDA-event timed, median of ``--iters``. The last column is what
``MLADims.absorbed_prefill_is_cheaper`` (the backend's rule) picks.

    python benchmarks/bench_mla_prefill_paths.py [--iters 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from encore.backends.base import MLADims
from encore.backends.flashinfer_backend import FlashInferAttentionBackend
from encore.backends.triton_backend import TritonAttentionBackend
from encore.engine.step import pack_batch

DIMS = MLADims(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
               softmax_scale=192 ** -0.5)
PAGE = 64
LAYOUTS = [(64, 32, 2048), (64, 32, 512), (16, 128, 1024), (8, 64, 4096), (4, 256, 256), (4, 1000, 0),
           (1, 4000, 0), (1, 512, 8192), (16, 512, 512)]


def step(rows: int, new: int, prefix: int, device: torch.device):
    seq = prefix + new
    width = -(-seq // PAGE)
    tables = [list(range(1 + r * width, 1 + (r + 1) * width)) for r in range(rows)]
    positions = [p for _ in range(rows) for p in range(prefix, seq)]
    slots = [t[p // PAGE] * PAGE + p % PAGE for t in tables for p in range(prefix, seq)]
    qo = [r * new for r in range(rows + 1)]
    return pack_batch(rows, 1, PAGE, [0] * len(positions), positions, slots, [seq] * rows, [prefix] * rows, qo,
                      tables, [], device), 1 + rows * width


def backend_with(path: bool | None):
    """The backend, its eager prefill path forced (True: absorbed, False: MHA) or its own (None)."""

    class Forced(FlashInferAttentionBackend):
        def absorbs_prefill(self, q_lens: list[int], prefix_lens: list[int]) -> bool:
            return super().absorbs_prefill(q_lens, prefix_lens) if path is None else path

    return Forced


def time_path(backend_name: str, path: bool, rows: int, new: int, prefix: int, iters: int
              ) -> tuple[float, float, torch.Tensor]:
    device = torch.device("cuda")
    batch, pages = step(rows, new, prefix, device)
    gen = torch.Generator(device).manual_seed(0)
    cache = torch.randn(pages, PAGE, DIMS.latent_dim, device=device, generator=gen, dtype=torch.bfloat16)
    n = rows * new
    h = DIMS.num_heads
    q_nope = torch.randn(n, h, DIMS.qk_nope_head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    q_pe = torch.randn(n, h, DIMS.qk_rope_head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    w_kc = torch.randn(h, DIMS.qk_nope_head_dim, DIMS.kv_lora_rank, device=device, generator=gen,
                       dtype=torch.bfloat16) * DIMS.kv_lora_rank ** -0.5
    w_vc = torch.randn(h, DIMS.v_head_dim, DIMS.kv_lora_rank, device=device, generator=gen,
                       dtype=torch.bfloat16) * DIMS.kv_lora_rank ** -0.5
    out = torch.empty(n, h, DIMS.v_head_dim, device=device, dtype=torch.bfloat16)
    if backend_name == "flashinfer":
        backend, static = backend_with(path)([cache], DIMS), False
    else:
        backend, static = TritonAttentionBackend([cache], DIMS), path  # its static path is the absorbed one
    plans, runs = [], []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        backend.plan(batch, static)
        t1 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        backend.prefill(q_nope, q_pe, w_kc, w_vc, cache, out, batch)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            plans.append(1e6 * (t1 - t0))
            runs.append(1e3 * start.elapsed_time(end))
    return statistics.median(runs), statistics.median(plans), out.float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows_out = []
    print(f"{torch.cuda.get_device_name()}, V2-Lite attention dims, bf16, pages of {PAGE}; µs, median of {args.iters}")
    print(f"{'backend':>10} {'rows x new, prefix':>22} {'MHA run':>9} {'plan':>7} {'absorbed run':>13} {'plan':>7} "
          f"{'rel diff':>9} {'rule picks':>11}")
    for backend in ("flashinfer", "triton"):
        for rows, new, prefix in LAYOUTS:
            mha, mha_plan, mha_out = time_path(backend, False, rows, new, prefix, args.iters)
            absorbed, absorbed_plan, absorbed_out = time_path(backend, True, rows, new, prefix, args.iters)
            diff = float((mha_out - absorbed_out).norm() / mha_out.norm())  # the two formulations agree
            pick = "absorbed" if DIMS.absorbed_prefill_is_cheaper([new] * rows, [prefix] * rows) else "MHA"
            rows_out.append({"backend": backend, "rows": rows, "new": new, "prefix": prefix, "mha_us": round(mha, 1),
                             "mha_plan_us": round(mha_plan, 1), "absorbed_us": round(absorbed, 1),
                             "absorbed_plan_us": round(absorbed_plan, 1), "rel_diff": diff, "rule": pick})
            print(f"{backend:>10} {f'{rows} x {new}, {prefix}':>22} {mha:>9.1f} {mha_plan:>7.0f} {absorbed:>13.1f} "
                  f"{absorbed_plan:>7.0f} {diff:>9.4f} {pick:>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=2)


if __name__ == "__main__":
    main()
