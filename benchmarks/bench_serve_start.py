"""How long ``encore serve`` takes to be ready, phase by phase, over several starts on one graph cache.

Each start is a fresh ``python -m encore.server.cli serve --port 0`` process, stopped with SIGINT once it is
ready. The first start on an empty ``--graph-cache-dir`` is cold (it compiles); the others are warm. Per
start, seconds: ``listening`` and ``ready`` from the launch, as this script receives those lines; the
engine's phases on ``encore serve``'s own clock (it starts when the server process has imported its
command line, ~0.05 s after the launch; each engine line carries the time the engine process wrote it):
``loading`` (the engine process has imported torch and the engine), ``weights`` (loaded; ``weights_s``:
how long that took, by the engine), ``first_key`` / ``last_key`` (the graph keys prepared),
``kernel_warm_up_s`` (compiling encore's own Triton kernels, ~0 once Triton's cache holds them) and
``ready``.

    python benchmarks/bench_serve_start.py [--model DIR] [--starts 3] [--graph-cache-dir DIR] [--json out.json]
        [--evict-checkpoint] [-- ENGINE OPTIONS ...]   # e.g. -- --device cuda --graph-decode-sizes 1,8

Without --graph-cache-dir the starts share a new temporary one, so the first is cold.
``--evict-checkpoint`` drops the checkpoint's files from the page cache before each start (a start
whose weights come off the disk: the first on a machine).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from encore.models.shards import checkpoint_files, evict

_CLOCK = re.compile(r"^encore: \[\s*([0-9.]+)s\] (.*)$")


def one_start(model: str | None, cache_dir: str, engine_args: list[str]) -> dict:
    command = [sys.executable, "-m", "encore.server.cli", "serve", "--port", "0", "--graph-cache-dir", cache_dir,
               *(["--model", model] if model else []), *engine_args]
    launched = time.monotonic()
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    phases: dict[str, float] = {}
    lines = []
    for line in server.stdout:
        lines.append(line)
        if "listening on" in line:
            phases["listening"] = time.monotonic() - launched
        clock = _CLOCK.match(line.strip())
        if clock is None:
            continue
        at, message = float(clock.group(1)), clock.group(2)
        if message.startswith("loading "):
            phases["loading"] = at
        elif weights := re.match(r"weights loaded: [0-9.]+ GB in ([0-9.]+)s", message):
            phases["weights"] = at
            phases["weights_s"] = float(weights.group(1))
        elif message.startswith("graph key 1/"):
            phases["first_key"] = at
        elif message.startswith("graph key "):
            phases["last_key"] = at
        elif warm := re.match(r"kernel warm-up: \d+ eager steps in ([0-9.]+)s", message):
            phases["kernel_warm_up_s"] = float(warm.group(1))
        elif message.startswith("ready: "):
            phases["ready"] = time.monotonic() - launched
            phases["ready_clock"] = at
            break
    server.send_signal(signal.SIGINT)
    rest, _ = server.communicate(timeout=60)
    if "ready" not in phases:
        raise RuntimeError(f"encore serve did not get ready:\n{''.join(lines)}{rest}")
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--graph-cache-dir")
    ap.add_argument("--json")
    ap.add_argument("--evict-checkpoint", action="store_true", help="drop --model's files from the page cache "
                    "before each start")
    ap.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: encore serve's engine options")
    args = ap.parse_args()
    if args.evict_checkpoint and not args.model:
        ap.error("--evict-checkpoint needs --model (the embedded model is part of the package)")
    engine_args = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    with tempfile.TemporaryDirectory(prefix="encore-start-") as scratch:
        cache_dir = args.graph_cache_dir or scratch
        starts = []
        for index in range(args.starts):
            if args.evict_checkpoint:
                evict(checkpoint_files(Path(args.model)))
            starts.append(one_start(args.model, cache_dir, engine_args))
            print(f"start {index + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in starts[-1].items()), flush=True)
    warm = starts[1:]
    summary = {key: statistics.median(start[key] for start in warm)
               for key in (warm[0] if warm else ()) if all(key in start for start in warm)}
    if summary:
        print("warm starts, median: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "engine_args": engine_args, "evict_checkpoint": args.evict_checkpoint,
                       "starts": starts, "warm_median": summary},
                      f, indent=1)


if __name__ == "__main__":
    main()
