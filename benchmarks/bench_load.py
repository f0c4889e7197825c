"""Loading a checkpoint's weights onto the GPU, against the floor of its two links and against the peer
reader: the storage read (every shard read by threads into host memory, the page cache when warm) and
the host-to-device copy (pinned, one large copy). The floor is the checkpoint's bytes over the slower
of the two, since a loader can overlap them. The peer is safetensors' own reader, as vLLM and SGLang
load by default: ``safe_open(...).get_tensor`` (a CPU tensor) then ``copy_`` to the parameter.

Each trial builds the model on the meta device and loads it (``encore.models.loader.load_model``, the
engine's path; ``--peer``: the same plan of tensors, read by safetensors), synchronized, the model freed
between trials; encore and the peer take turns. ``--cold`` evicts the shards from the page cache first
(``posix_fadvise(DONTNEED)``; no root needed), so that trials read the disk.

    python benchmarks/random_checkpoint.py /tmp/v2l --layers 27 --device cuda
    python benchmarks/bench_load.py --model /tmp/v2l --trials 3 [--peer] [--cold] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
from safetensors import safe_open

from encore.models import loader
from encore.models.config import ModelConfig
from encore.models.shards import checkpoint_files, evict, prefetch
from encore.models.weight_stream import StoredTensor


def read_seconds(files: list[Path], threads: int) -> float:
    """Every shard's bytes read by ``threads`` threads (the prefetch's reader: 16 MB pieces in order)."""
    start = time.perf_counter()
    prefetch(files, budget=sum(p.stat().st_size for p in files), threads=threads)
    return time.perf_counter() - start


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


def safetensors_read_into(pairs: list[tuple[StoredTensor, torch.Tensor]]) -> None:
    """The peer: each tensor through safetensors' ``get_tensor``, then a blocking ``copy_``."""
    for path in dict.fromkeys(src.path for src, _ in pairs):
        with safe_open(path, "pt") as f:
            for src, dest in pairs:
                if src.path == path:
                    dest.copy_(f.get_tensor(src.name))


def load_seconds(model_dir: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 peer: bool = False) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    with mock.patch.object(loader, "read_into", safetensors_read_into) if peer else contextlib.nullcontext():
        model = loader.load_model(model_dir, cfg, None, device, dtype)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--peer", action="store_true", help="also time safetensors' reader, in turns with encore's")
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
    floor_s = max(read_s, nbytes / (h2d * 1e9))
    sides = ["encore", "peer"] if args.peer else ["encore"]
    trials: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.trials):
        for side in sides:
            if args.cold:
                evict(files)
            trials[side].append(load_seconds(args.model, cfg, device, dtype, peer=side == "peer"))
    result = {"device": torch.cuda.get_device_name(device), "model": str(args.model), "gb": nbytes / 1e9,
              "shards": len(files), "cold": args.cold, "read_s": read_s, "read_gbps": nbytes / read_s / 1e9,
              "h2d_gbps": h2d, "floor_s": floor_s, "load_s": trials,
              "load_median_s": {side: statistics.median(t) for side, t in trials.items()}}
    print(f"{result['device']}: {nbytes / 1e9:.1f} GB in {len(files)} shards ({'cold' if args.cold else 'page cache'})")
    print(f"  read {read_s:.2f} s ({result['read_gbps']:.1f} GB/s, {args.read_threads} threads), "
          f"H2D {h2d:.1f} GB/s: floor {floor_s:.2f} s")
    for side, times in trials.items():
        median = result["load_median_s"][side]
        print(f"  {side:6s} {', '.join(f'{t:.2f}' for t in times)} s: median {median:.2f} s "
              f"({nbytes / median / 1e9:.1f} GB/s, {median / floor_s:.2f}x floor)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
