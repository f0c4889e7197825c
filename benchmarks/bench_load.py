"""Loading a checkpoint's weights onto the GPU, against the floor of its two links: the storage read
(every shard read by threads into host memory, the page cache when warm) and the host-to-device copy
(pinned, one large copy). The floor is the checkpoint's bytes over the slower of the two, since a
loader can overlap them.

Each trial builds the model on the meta device and loads it (``encore.models.loader.load_model``, the
engine's path), synchronized, the model freed between trials. ``--cold`` evicts the shards from the page
cache first (``posix_fadvise(DONTNEED)``; no root needed), so that trials read the disk.

    python benchmarks/random_checkpoint.py /tmp/v2l --layers 27 --device cuda
    python benchmarks/bench_load.py --model /tmp/v2l --trials 3 [--cold] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from bench_serve_start import evict

from encore.models.config import ModelConfig
from encore.models.loader import load_model
from encore.models.shards import checkpoint_files

_READ_CHUNK = 16 << 20


def read_seconds(files: list[Path], threads: int) -> float:
    """Every shard's bytes read in 16 MB pieces by ``threads`` threads, each into a buffer of its own."""
    pieces = [(path, off) for path in files for off in range(0, path.stat().st_size, _READ_CHUNK)]
    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    local = threading.local()

    def read(piece: tuple[Path, int]) -> None:
        if not hasattr(local, "buf"):
            local.buf = bytearray(_READ_CHUNK)
        os.preadv(fds[piece[0]], [local.buf], piece[1])

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, pieces))
        return time.perf_counter() - start
    finally:
        for fd in fds.values():
            os.close(fd)


def h2d_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return nbytes / min(times) / 1e9


def load_seconds(model_dir: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    model = load_model(model_dir, cfg, None, device, dtype)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="evict the shards from the page cache before each trial")
    ap.add_argument("--read-threads", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    files = checkpoint_files(args.model)
    nbytes = sum(p.stat().st_size for p in files)
    cfg = ModelConfig.from_pretrained(args.model)
    if args.cold:
        evict(files)
    read_s = read_seconds(files, args.read_threads)
    h2d = h2d_gbps(device)
    trials = []
    for _ in range(args.trials):
        if args.cold:
            evict(files)
        trials.append(load_seconds(args.model, cfg, device, dtype))
    floor_s = max(read_s, nbytes / (h2d * 1e9))
    load_s = statistics.median(trials)
    result = {"device": torch.cuda.get_device_name(device), "model": str(args.model), "gb": nbytes / 1e9,
              "shards": len(files), "cold": args.cold, "read_s": read_s, "read_gbps": nbytes / read_s / 1e9,
              "h2d_gbps": h2d, "floor_s": floor_s, "load_s": trials, "load_median_s": load_s,
              "load_gbps": nbytes / load_s / 1e9, "x_floor": load_s / floor_s}
    print(f"{result['device']}: {nbytes / 1e9:.1f} GB in {len(files)} shards ({'cold' if args.cold else 'page cache'})")
    print(f"  read {read_s:.2f} s ({result['read_gbps']:.1f} GB/s, {args.read_threads} threads), "
          f"H2D {h2d:.1f} GB/s: floor {floor_s:.2f} s")
    print(f"  load_model {', '.join(f'{t:.2f}' for t in trials)} s: median {load_s:.2f} s "
          f"({result['load_gbps']:.1f} GB/s, {result['x_floor']:.2f}x floor)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
