"""Host cost of one step's scheduling + step building + sampling tensors, at bs = 64 (CPU only).

Floor: the same step's tensors built from ready-made Python lists (the ``host_tensor`` calls alone),
measured in the same run; the gap to it is encore's Python bookkeeping.

    python benchmarks/bench_scheduler.py [--bs 64] [--context 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from encore.backends.host_tensors import host_tensor
from encore.engine.detokenizer import IncrementalDetokenizer
from encore.engine.kv_cache import KVCacheManager
from encore.engine.request import Request, RequestStatus
from encore.engine.sampling_params import SamplingParams
from encore.engine.scheduler import Scheduler
from encore.engine.step import build_forward_batch, sampling_tensors


def setup(bs: int, context: int, prefills: int, page_size: int) -> Scheduler:
    kv = KVCacheManager(num_pages=(bs + prefills) * (context // page_size + 4) + 2, page_size=page_size)
    sched = Scheduler(kv, max_num_batched_tokens=bs + 512 * prefills, chunked_prefill_size=512,
                      max_num_seqs=bs + prefills, mixed=True)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=1 << 20)
    for i in range(bs):
        req = Request(f"d{i}", list(range(context)), params, i, IncrementalDetokenizer(None, [], ()))
        req.token_ids.append(1)
        req.num_computed = context
        req.status = RequestStatus.RUNNING
        kv.reserve(req.request_id, context)
        sched.running.append(req)
    for i in range(prefills):
        sched.add(Request(f"p{i}", list(range(4 * context)), params, i, IncrementalDetokenizer(None, [], ())))
    return sched


def one_step(sched: Scheduler) -> None:
    step = sched.schedule()
    batch, sampled = build_forward_batch(step, sched.kv, torch.device("cpu"))
    sampling_tensors(sampled, torch.device("cpu"))
    for req, n in step.extends:
        req.num_computed += n
    for req in step.decodes:
        req.num_computed += 1
        req.token_ids.append(1)


def floor_step(n_tokens: int, bs: int, max_pages: int, n_logits: int) -> None:
    """The step's host tensors from ready lists, one per dtype as the engine builds them."""
    host_tensor([0] * (3 * n_tokens + n_logits), torch.int64)  # ids, positions, slots, logits rows
    host_tensor([0] * (3 * bs + 1 + bs * max_pages), torch.int32)  # lengths, qo_indptr, page table
    host_tensor([0.0] * (6 * n_logits), torch.float32)  # sampling parameters
    host_tensor([0] * (3 * n_logits), torch.int64)  # seeds, counters, top-k


def timed(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for label, prefills in (("DECODE", 0), ("MIXED (+2 prefill chunks of 512)", 2)):
        sched = setup(args.bs, args.context, prefills, args.page_size)
        us = timed(lambda: one_step(sched), args.iters)
        n_tokens = args.bs + 512 * prefills
        max_pages = (args.context + args.iters + 20) // args.page_size + 1
        floor = timed(lambda: floor_step(n_tokens, args.bs + prefills, max_pages, args.bs), args.iters)
        rows.append({"step": label, "bs": args.bs, "context": args.context, "host_us": round(us, 1),
                     "floor_us": round(floor, 1), "ratio": round(us / floor, 2)})
    print(f"{'step':34} {'bs':>4} {'ctx':>6} {'host µs':>9} {'floor µs':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['step']:34} {r['bs']:>4} {r['context']:>6} {r['host_us']:>9} {r['floor_us']:>9} {r['ratio']:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
