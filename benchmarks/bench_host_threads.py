"""Host ops against torch's intra-op pool (``model_runner.serial_host_ops``): the time of one host op of a
CUDA engine's step, ``allocate_bitmask`` (a structured-output step's token bitmask, ``rows`` x vocabulary
bits), with the pool torch started with and with one thread, in two settings:

- free: the process may use every CPU it started with;
- narrowed: after torch started its pool, the process is held to ``--cpus`` CPUs (as ``bench_server.py
  --pin`` does, or a container's CPU limit, which torch does not see at all).

Each row is the median (and p90) over ``--iters`` calls, each after ``--serial-us`` of pure Python work
(the engine loop's own work between such ops).

    python benchmarks/bench_host_threads.py [--rows 64] [--vocab 102400] [--cpus 1] [--iters 300]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from bench_server import pin
from encore.engine.grammar import allocate_bitmask


def spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def measure(rows: int, vocab: int, threads: int, iters: int, serial_us: float) -> dict:
    torch.set_num_threads(threads)
    for _ in range(20):
        allocate_bitmask(rows, vocab)
    times = []
    for _ in range(iters):
        spin(serial_us)
        start = time.perf_counter()
        allocate_bitmask(rows, vocab)
        times.append(time.perf_counter() - start)
    times.sort()
    return {"threads": threads, "median_us": 1e6 * statistics.median(times),
            "p90_us": 1e6 * times[int(0.9 * (len(times) - 1))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--cpus", type=int, default=1, help="CPUs the process is held to in the narrowed setting")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--serial-us", type=float, default=200.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    started = sorted(os.sched_getaffinity(0))
    pool = torch.get_num_threads()
    if args.cpus >= pool:
        raise SystemExit(f"--cpus {args.cpus} must be under torch's pool of {pool} threads")
    rows = []
    for setting in ("free", "narrowed"):
        if setting == "narrowed":
            pin(os.getpid(), set(started[:args.cpus]))  # every thread, torch's pool included
        for threads in (pool, 1):
            row = {"setting": setting, **measure(args.rows, args.vocab, threads, args.iters, args.serial_us)}
            rows.append(row)
    print(f"{platform.node()}: {len(started)} CPUs at start, torch pool {pool} threads; bitmask {args.rows} x "
          f"{args.vocab} bits ({args.rows * -(-args.vocab // 32)} int32); narrowed to {args.cpus} CPU(s)")
    print(f"{'setting':10} {'threads':>7} {'median us':>10} {'p90 us':>10}")
    for r in rows:
        print(f"{r['setting']:10} {r['threads']:>7} {r['median_us']:>10.1f} {r['p90_us']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus_at_start": len(started), "pool": pool, **vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
