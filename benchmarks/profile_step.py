"""Where a step of encore-tiny goes on the GPU: plain decoding against MTP speculation.

For each engine (plain, then MTP with k drafts; CUDA graphs, greedy, ``--bs`` prompts of ``--max-tokens``):
wall time per engine step with no profiler (median of ``--repeats`` generate calls), then one generate call
under the torch profiler for the GPU kernel time and launches per step and the largest kernels. The peer
of the MTP rows is the plain engine, measured in the same run; tokens per step come from the engine's
own acceptance. The host time of each phase of a step (scheduling, step building, padding, replays,
the read-back that waits for the GPU, commit) comes from timers wrapped around those functions, over one
more generate call. ``--host`` adds one generate call under cProfile: the functions with the most host
time of their own per step.

    python benchmarks/profile_step.py [--k 3] [--dtype bfloat16] [--compile] [--bs 1] [--top 20] [--host]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from bench_spec import KEYS, PROMPTS
from encore.engine import Engine, SamplingParams
from encore.engine import engine as engine_module
from encore.engine.head_graphs import HeadGraphs
from encore.engine.model_runner import ModelRunner
from encore.engine.scheduler import Scheduler
from encore.engine.spec.draft_graphs import DraftGraphs
from encore.engine.spec.speculator import Speculator
from encore.graphs.padding import StepBuffers
from encore.graphs.runner import GraphRunner
from encore.server.engine_worker import freeze_start_up_heap

# (owner, attribute, label): the host phases of a step, timed inclusively (a phase's time holds its callees').
PHASES = [
    (engine_module.Engine, "step", "step"),
    (Scheduler, "schedule", "schedule"),
    (engine_module, "build_forward_batch", "build_forward_batch"),
    (engine_module.Engine, "_sample", "plain: forward + pick"),
    (Speculator, "run", "spec: verify + draft"),
    (ModelRunner, "forward", "target forward"),
    (StepBuffers, "fill", "  pad into graph buffers"),
    (GraphRunner, "run", "  graph run (fill, plan, replay)"),
    (HeadGraphs, "run", "head graph replay"),
    (DraftGraphs, "run", "draft graph replay"),
    (torch.Tensor, "copy_", "Tensor.copy_ (host-to-device in steps)"),
    (torch.Tensor, "to", "Tensor.to (host-to-device in steps)"),
    (torch.Tensor, "tolist", "read-back (waits for the GPU)"),
    (torch.cuda.Event, "synchronize", "read-back behind the launches (waits for its event)"),
    (engine_module.Engine, "_commit", "commit"),
]


def steps_of(engine: Engine) -> int:
    return sum(engine.stats()["steps"].values())


def host_profile(engine: Engine, prompts: list[str], params: SamplingParams, top: int) -> list[dict]:
    """Host µs per engine step over one generate call: the ``top`` functions by time of their own, then
    encore's functions by cumulative time (where a step's host work goes, callee by callee)."""
    before = steps_of(engine)
    profiler = cProfile.Profile()
    profiler.runcall(engine.generate, prompts, params)
    steps = steps_of(engine) - before
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, _)
    by_own = sorted(stats, key=lambda f: stats[f][2], reverse=True)[:top]
    ours = [f for f in stats if "/encore/" in f[0] or any(f"/{d}/" in f[0] for d in ("engine", "graphs", "backends"))]
    by_cumulative = sorted(ours, key=lambda f: stats[f][3], reverse=True)[:top]
    return [{"function": f"{name} ({file.rsplit('/', 2)[-1]}:{line})", "sort": sort,
             "own_us_per_step": round(stats[f][2] / steps * 1e6, 1),
             "cumulative_us_per_step": round(stats[f][3] / steps * 1e6, 1),
             "calls_per_step": round(stats[f][0] / steps, 2)}
            for sort, functions in (("own", by_own), ("cumulative", by_cumulative))
            for f in functions for file, line, name in [f]]


@contextmanager
def phase_timers():
    """Wraps each of PHASES with a perf_counter timer while the block runs; yields {label: [seconds, calls]}."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    saved = []
    for owner, attr, label in PHASES:
        original = getattr(owner, attr)

        def timed(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                entry = totals[_label]
                entry[0] += time.perf_counter() - start
                entry[1] += 1

        saved.append((owner, attr, original))
        setattr(owner, attr, functools.wraps(original)(timed))
    try:
        yield totals
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def phases(engine: Engine, prompts: list[str], params: SamplingParams) -> list[dict]:
    """Host µs per engine step in each phase over one generate call, timers only (no profiler)."""
    before = steps_of(engine)
    with phase_timers() as totals:
        engine.generate(prompts, params)
    steps = steps_of(engine) - before
    return [{"phase": label, "us_per_step": round(totals[label][0] / steps * 1e6, 1),
             "calls_per_step": round(totals[label][1] / steps, 2)} for _, _, label in PHASES if label in totals]


def measure(engine: Engine, prompts: list[str], params: SamplingParams, repeats: int, top: int, host: bool) -> dict:
    engine.generate(prompts, params)  # first replays upload their graphs
    per_step = []
    for _ in range(repeats):
        before = steps_of(engine)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, params)
        per_step.append((time.perf_counter() - start) / (steps_of(engine) - before))
    timed_phases = phases(engine, prompts, params)
    hosts = host_profile(engine, prompts, params, top) if host else []  # before the torch profiler, which
    # leaves its CUDA callbacks behind and slows every later launch
    before = steps_of(engine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    steps = steps_of(engine) - before
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    stats = engine.stats()
    return {
        "step_us": round(statistics.median(per_step) * 1e6, 1),
        "step_us_range": [round(min(per_step) * 1e6, 1), round(max(per_step) * 1e6, 1)],
        "steps": steps,
        "kernel_us_per_step": round(sum(e.self_device_time_total for e in kernels) / steps, 1),
        "launches_per_step": round(sum(e.count for e in kernels) / steps, 1),
        "top": [{"name": e.key[:90], "us_per_step": round(e.self_device_time_total / steps, 2),
                 "per_step": round(e.count / steps, 2)} for e in kernels[:top]],
        "mean_accepted_len": round(stats.get("spec_mean_accepted_length", 1.0) or 1.0, 2),
        "phases": timed_phases,
        "host": hosts,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--host", action="store_true", help="also cProfile one generate call")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: encore-tiny)")
    ap.add_argument("--json")
    args = ap.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.bs)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engines = {}
    for name, spec in (("plain", None), (f"mtp k={args.k}", {"method": "mtp", "num_speculative_tokens": args.k})):
        engines[name] = Engine(model=args.model, device="cuda", dtype=args.dtype, compile=args.compile,
                               cuda_graphs=True, max_model_len=512, num_kv_pages=1 + args.bs * 512 // 16,
                               speculative=spec, **KEYS)
    freeze_start_up_heap()
    rows = {name: measure(engine, prompts, params, args.repeats, args.top, args.host)
            for name, engine in engines.items()}
    plain = rows["plain"]
    print(f"{torch.cuda.get_device_name()}  encore-tiny {args.dtype} compile={args.compile} bs={args.bs}")
    print(f"{'engine':>10} {'step µs':>9} {'kernels µs':>11} {'launches':>9} {'tokens/step':>12} "
          f"{'step / plain':>13}")
    for name, r in rows.items():
        print(f"{name:>10} {r['step_us']:>9} {r['kernel_us_per_step']:>11} {r['launches_per_step']:>9} "
              f"{r['mean_accepted_len']:>12} {r['step_us'] / plain['step_us']:>13.2f}")
    print(f"--- host µs a step by phase (inclusive), {' / '.join(rows)}")
    labels = [p["phase"] for r in rows.values() for p in r["phases"]]
    for label in dict.fromkeys(labels):
        cells = [next((f"{p['us_per_step']:>8} ({p['calls_per_step']})"
                       for p in r["phases"] if p["phase"] == label), f"{'-':>8}") for r in rows.values()]
        print(f"{label:>34} " + "  ".join(cells))
    for name, r in rows.items():
        print(f"--- {name}: largest kernels (µs a step, launches a step)")
        for k in r["top"]:
            print(f"{k['us_per_step']:>9} {k['per_step']:>6}  {k['name']}")
        if r["host"]:
            print(f"--- {name}: host µs a step under cProfile (own, cumulative, calls a step): top by own time, "
                  "then encore's by cumulative time")
            for h in r["host"]:
                print(f"{h['own_us_per_step']:>9} {h['cumulative_us_per_step']:>9} {h['calls_per_step']:>6}  "
                      f"{h['function']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "compile": args.compile,
                       "bs": args.bs, "k": args.k, "engines": rows}, f, indent=2)


if __name__ == "__main__":
    main()
