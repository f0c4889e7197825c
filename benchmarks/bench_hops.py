"""What a dependent hop costs on the GPU: a chain of kernels launched as programmatic dependents (PDL)
against one persistent kernel whose stages meet at grid-wide barriers.

A bs-1 decode step is a chain of ~14 dependent kernels a layer, most of them moving little data. A
persistent kernel (one launch, every program looping over the stages and spinning on a global counter
between them) is the usual proposal for such chains. This measures the premise: the time a stage
takes when its work is small and when it reads a weight at full bandwidth.

Each stage s computes x_{s+1} = W_s x_s (W_s [D, D] bf16, every stage its own weight, 32 stages, so
together they are many times the L2 at D = 2048):
- ``gemv_pdl``: encore's GEMV (gemv_triton.py), one launch a stage, each a programmatic dependent that
  reads its weight before it waits for the one before; ``gemv_plain``: the same launched plainly;
- ``persistent_p{P}_w{W}``: one launch of P programs on W warps; each program reads its rows of the
  stage's weight, then spins on the counter of the stage before until all P programs have arrived,
  reads x past L1, multiplies, stores its rows and arrives (release) at its stage's counter. P must
  not exceed the programs the GPU holds at once (else it deadlocks): P <= 2 × SMs here.
Floor: the weight's bytes over the copy bandwidth (read + write of a large ``copy_``) measured in the
same run. Every variant's output is checked against a float32 chain of the same bf16 roundings.

    python benchmarks/bench_hops.py [--stages 32] [--dims 512 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from bench_mla_decode import copy_bandwidth, graph_time_us
from encore.backends import gemv_triton

PERSISTENT = ((64, 8), (128, 4), (128, 8), (256, 4))  # (programs, warps)


@triton.jit
def _chain_kernel(XS, W, ARRIVED, stages, D: tl.constexpr, ROWS: tl.constexpr):
    programs = tl.num_programs(0)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    for s in range(stages):
        w = tl.load(W + s.to(tl.int64) * D * D + rows[:, None] * D + cols[None, :])
        if s > 0:
            arrived = tl.atomic_add(ARRIVED + s - 1, 0, sem="acquire")
            while arrived < programs:
                arrived = tl.atomic_add(ARRIVED + s - 1, 0, sem="acquire")
        x = tl.load(XS + s * D + cols, cache_modifier=".cg").to(tl.float32)
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(XS + (s + 1) * D + rows, y.to(XS.dtype.element_ty))
        tl.debug_barrier()  # every thread's store before the arrival, which releases them
        tl.atomic_add(ARRIVED + s, 1, sem="release")


def measure(dim: int, stages: int, bandwidth: float) -> dict:
    w = (torch.randn(stages, dim, dim, device="cuda") * dim ** -0.5).to(torch.bfloat16)
    xs = torch.zeros(stages + 1, dim, dtype=torch.bfloat16, device="cuda")
    xs[0] = torch.randn(dim, device="cuda").to(torch.bfloat16)
    want = [xs[0].float()]
    for s in range(stages):
        want.append((w[s].float() @ want[-1]).to(torch.bfloat16).float())
    want = torch.stack(want[1:])
    row = {"dim": dim, "stages": stages, "floor_us": round(dim * dim * 2 / bandwidth * 1e6, 2)}

    def timed(name: str, call) -> None:
        xs[1:] = 0
        row[name] = round(graph_time_us([call], reps=50) / stages, 2)
        row[name + "_max_err"] = round((xs[1:].float() - want).abs().max().item(), 4)

    for pdl in (True, False):
        timed("gemv_pdl" if pdl else "gemv_plain", lambda pdl=pdl: [
            gemv_triton.batched_gemv(xs[s:s + 1, None], w[s:s + 1], xs[s + 1:s + 2, None], pdl) for s in range(stages)])
    arrived = torch.zeros(stages, dtype=torch.int32, device="cuda")
    most = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    for programs, warps in PERSISTENT:
        if programs <= most and dim % programs == 0:
            def call(programs=programs, warps=warps):
                arrived.zero_()
                _chain_kernel[(programs,)](xs, w, arrived, stages, D=dim, ROWS=dim // programs, num_warps=warps)
            timed(f"persistent_p{programs}_w{warps}", call)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=32)
    ap.add_argument("--dims", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    rows = [measure(dim, args.stages, bandwidth) for dim in args.dims]
    names = [k for k in rows[0] if k not in ("dim", "stages", "floor_us") and not k.endswith("_max_err")]
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; µs a stage "
          f"(max abs error against the float32 chain)")
    print("| D | floor | " + " | ".join(names) + " |")
    for r in rows:
        print(f"| {r['dim']} | {r['floor_us']} | " + " | ".join(f"{r[n]} ({r[n + '_max_err']})" for n in names) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
