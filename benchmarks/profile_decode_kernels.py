"""Where a decode step of DeepSeek-V2-Lite's shape goes on the GPU, kernel by kernel, in the real engine
(random bf16 weights, ``bench_overlap.v2_lite_engine``: CUDA graphs, overlapped steps).

``--bs`` requests of ``--context`` random prompt tokens are stepped until each has its first token;
the next ``--steps`` decode steps run under the torch profiler. Each kernel is charged its share of
the critical path: the time from the later of its start and the latest end of the kernels that
started before it to its own end (0 where it ends under another one: a programmatic dependent that
waits for the kernel before it is charged only what it adds after that kernel ends), so the shares
of a step and its idle gaps add up to its GPU span. Kernels are grouped by name and grid (a GEMV's
grid tells its weights apart), a row each: launches a step, the median share and duration of a
launch, and the share a step (the rows sorted by it). The idle time between kernels is a row of its
own. Medians of a launch are over every layer of every profiled step. Then the middle step's kernels
one by one, in launch order (``--timeline`` of them, from its ``--timeline-from``-th): start from the
step's first kernel, duration, share, idle before.

    python benchmarks/profile_decode_kernels.py [--bs 1] [--context 1024] [--steps 32]
        [--attention-backend auto] [--top 30] [--timeline 40] [--timeline-from 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

from bench_overlap import v2_lite_engine
from encore.engine import SamplingParams

IDLE = "(GPU idle between kernels)"


class PathRow(NamedTuple):
    """A kernel on the critical path (µs): ``share`` is what it adds after the latest end before it,
    ``idle`` the gap between that end and its start."""

    name: str
    start: float
    duration: float
    share: float
    idle: float


def critical_path(kernels: list[tuple[str, float, float]]) -> list[PathRow]:
    """(name, start, duration) of every kernel, in any order -> its ``PathRow`` in start order: share =
    its end minus the later of its start and the latest end before it (at least 0), idle = the time
    between that latest end and its start (0 if it starts before it)."""
    rows, latest = [], None
    for name, start, duration in sorted(kernels, key=lambda k: k[1]):
        end = start + duration
        begin = start if latest is None else max(start, latest)
        rows.append(PathRow(name, start, duration, max(0.0, end - begin),
                            0.0 if latest is None else max(0.0, start - latest)))
        latest = end if latest is None else max(latest, end)
    return rows


def attribute(path: list[PathRow], steps: int) -> list[dict]:
    """``critical_path``'s rows grouped by kernel name, plus the idle time as one row: launches a step,
    median duration and share of a launch, share a step; sorted by share a step."""
    by_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in path:
        by_name[row.name].append((row.duration, row.share))
    idle = [row.idle for row in path]
    rows = [{"kernel": name, "launches_per_step": round(len(runs) / steps, 2),
             "median_us": round(statistics.median(d for d, _ in runs), 2),
             "median_share_us": round(statistics.median(s for _, s in runs), 2),
             "share_us_per_step": round(sum(s for _, s in runs) / steps, 2)} for name, runs in by_name.items()]
    rows.append({"kernel": IDLE, "launches_per_step": round(sum(g > 0 for g in idle) / steps, 2), "median_us": 0.0,
                 "median_share_us": round(statistics.median(idle), 2) if idle else 0.0,
                 "share_us_per_step": round(sum(idle) / steps, 2)})
    return sorted(rows, key=lambda r: r["share_us_per_step"], reverse=True)


def step_timeline(path: list[PathRow], steps: int, step: int) -> list[dict]:
    """``critical_path``'s rows of one step (each step launches the same number of kernels), its start
    made relative to the step's first kernel."""
    if len(path) % steps:
        raise ValueError(f"{len(path)} kernels in {steps} steps: the steps differ in their kernels")
    per_step = len(path) // steps
    rows = path[step * per_step:(step + 1) * per_step]
    return [{"kernel": r.name, "start_us": round(r.start - rows[0].start, 2), "us": round(r.duration, 2),
             "share_us": round(r.share, 2), "idle_before_us": round(r.idle, 2)} for r in rows]


def kernel_family(name: str) -> str:
    """A kernel's name with what changes with the shape left out: cuBLAS's GEMMs (``nvjet_*``, whose names
    give the tile cuBLAS chose for the shape) as one, a C++ template kernel by its name before its
    template arguments (flashinfer's MLA kernel has other ones at q_len 1 and 4); others as they are."""
    if name.startswith("nvjet_"):
        return "cuBLAS GEMMs (nvjet_*)"
    return name.split("<", 1)[0] if "<" in name else name


def differences(before: list[dict], after: list[dict], key=lambda name: name) -> list[dict]:
    """Two ``attribute`` tables (of the same steps at two shapes) joined by ``key`` of the kernel's name
    (e.g. ``kernel_family``; the kernels of one key summed): launches and share a step in each and the
    share's change, largest increase first; a key missing from one has 0 there."""
    rows = {}
    for side, table in (("before", before), ("after", after)):
        for r in table:
            kernel = key(r["kernel"])
            row = rows.setdefault(kernel, {"kernel": kernel, "launches_before": 0.0, "launches_after": 0.0,
                                           "share_us_before": 0.0, "share_us_after": 0.0})
            row[f"launches_{side}"] += r["launches_per_step"]
            row[f"share_us_{side}"] += r["share_us_per_step"]
    for row in rows.values():
        for field in ("launches_before", "launches_after", "share_us_before", "share_us_after"):
            row[field] = round(row[field], 2)
        row["delta_us"] = round(row["share_us_after"] - row["share_us_before"], 2)
    return sorted(rows.values(), key=lambda r: r["delta_us"], reverse=True)


def trace_kernels(prof, grids: bool = True) -> list[tuple[str, float, float]]:
    """(name, with its grid unless ``grids`` is False; start µs, duration µs) of the GPU kernels in a
    finished profile (its Chrome trace)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return [(f"{e['name']} {tuple(e['args']['grid'])}" if grids and "grid" in e.get("args", {}) else e["name"],
             float(e["ts"]), float(e["dur"])) for e in kernels]


def profile_decode(engine, bs: int, context: int, steps: int) -> list[tuple[str, float, float]]:
    """The kernels of ``steps`` decode steps of ``bs`` fresh requests, after every request's first token."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(bs):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(context)], params)
    started: set[str] = set()
    while len(started) < bs:
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    kernels = profiled_kernels(engine.step, steps)
    while engine.has_unfinished_requests():
        engine.step()
    return kernels


def profiled_kernels(step, steps: int, grids: bool = True) -> list[tuple[str, float, float]]:
    """``trace_kernels`` of ``steps`` calls of ``step`` under the torch profiler."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return trace_kernels(prof, grids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bs", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--timeline", type=int, default=40)
    parser.add_argument("--timeline-from", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    engine = v2_lite_engine([args.bs], args.context, args.steps + 8, args.attention_backend)
    profile_decode(engine, args.bs, args.context, args.steps)  # warm-up: the first replays upload their graphs
    kernels = profile_decode(engine, args.bs, args.context, args.steps)
    path = critical_path(kernels)
    rows = attribute(path, args.steps)
    span = (max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)) / args.steps
    device = torch.cuda.get_device_name()
    print(f"{device}, V2-Lite shape, bs {args.bs} x {args.context}, {args.steps} decode steps: GPU span "
          f"{span:.1f} µs a step, {len(kernels) / args.steps:.1f} kernels a step")
    print("| kernel | launches a step | median µs | median share µs | share µs a step |\n|---|---|---|---|---|")
    for r in rows[:args.top]:
        print(f"| {r['kernel'][:90]} | {r['launches_per_step']} | {r['median_us']} | {r['median_share_us']} | "
              f"{r['share_us_per_step']} |")
    timeline = step_timeline(path, args.steps, args.steps // 2)
    print(f"\nstep {args.steps // 2}, kernels {args.timeline_from}.. in launch order\n"
          "| # | kernel | start µs | µs | share µs | idle before µs |\n|---|---|---|---|---|---|")
    for i, r in enumerate(timeline[args.timeline_from:args.timeline_from + args.timeline], args.timeline_from):
        print(f"| {i} | {r['kernel'][:90]} | {r['start_us']} | {r['us']} | {r['share_us']} | {r['idle_before_us']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "args": vars(args), "span_us_per_step": span,
                                               "stats": engine.stats(), "rows": rows,
                                               "timeline": timeline}, indent=1))


if __name__ == "__main__":
    main()
