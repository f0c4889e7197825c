"""Time to first token by prompt length, for sets of prefill buckets (``graph_prefill_tokens``).

A prompt step that a graph key holds replays a CUDA graph, padded up to the key's bucket; a longer one
runs unpadded on its family's compiled graph, whose launches the host makes one by one. This measures
which is faster at each length, on DeepSeek-V2-Lite's shape (random bf16 weights made on the GPU:
``bench_overlap.random_v2_lite``; pages of 64; prefix caching off; every other engine option its
default, so all graph keys are built as ``encore serve`` builds them). Each bucket set gets its own
engine in a subprocess of its own, one after the other:

- start-up: build seconds, keys, the seconds the keys with a bucket of ``--large`` tokens or more
  took to run and capture, the CUDA graph pool, the memory free after the build;
- EXTEND: one prompt of each length into the idle engine, then its first token (``max_tokens=1``);
- MIXED: 4 requests decoding, then one prompt of each length arriving, until its first token.

TTFT is the median of ``--trials`` (after one warm-up of each length); the engine's counters say
whether the prompt's steps replayed a graph or ran compiled.

    python benchmarks/bench_ttft.py [--buckets 128,512 128,512,1024,2048] [--lengths ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

DECODING = 4  # requests decoding when a MIXED trial's prompt arrives


def run_one(buckets: tuple[int, ...], lengths: list[int], trials: int, large: int) -> dict:
    import torch

    from bench_overlap import random_v2_lite
    from encore.engine import SamplingParams

    reports = []
    start = time.perf_counter()
    engine = random_v2_lite(max_model_len=8192, enable_prefix_caching=False, graph_prefill_tokens=buckets,
                            on_graph_key=lambda done, total, report: reports.append(report))
    build_s = time.perf_counter() - start
    large_keys = [r for r in reports if r.key.num_extends and r.key.num_extend_tokens >= large]
    row = {"buckets": list(buckets), "build_s": build_s, "keys": len(reports), "large_keys": len(large_keys),
           "large_keys_run_s": sum(r.compile_s for r in large_keys),
           "large_keys_capture_s": sum(r.capture_s for r in large_keys),
           "keys_run_s": sum(r.compile_s for r in reports), "pool_mib": sum(r.pool_bytes for r in reports) / 2**20,
           "free_gib": torch.cuda.mem_get_info()[0] / 2**30, "extend": {}, "mixed": {}}
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    endless = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def first_token(request_id: str, n: int) -> float:
        engine.add_request(request_id, prompt(n), first)
        start = time.perf_counter()
        while not any(o.request_id == request_id and o.new_token_ids for o in engine.step()):
            pass
        return (time.perf_counter() - start) * 1e3

    def settle() -> None:
        for request_id in list(engine.requests):
            engine.abort(request_id)
        while engine.has_unfinished_requests():
            engine.step()

    for n in lengths:
        for kind in ("extend", "mixed"):
            times, before = [], engine.stats()
            for trial in range(1 + trials):
                if kind == "mixed":
                    for i in range(DECODING):
                        engine.add_request(f"d{n}-{trial}-{i}", prompt(64), endless)
                    for _ in range(4):
                        engine.step()
                times.append(first_token(f"{kind}{n}-{trial}", n))
                settle()
            after = engine.stats()
            row[kind][n] = {"ttft_ms": statistics.median(times[1:]), "trials_ms": times[1:],
                            **{name: after[name] - before[name] for name in ("graph_replays", "compiled_steps",
                                                                             "eager_steps")}}
            print(f"{buckets} {kind} {n}: {row[kind][n]['ttft_ms']:.2f} ms", file=sys.stderr, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", nargs="+", default=["128,512", "128,512,1024,2048"],
                        help="bucket sets, each comma-separated")
    parser.add_argument("--lengths", default="300,600,1000,1100,1500,2000,2100,3000")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--large", type=int, default=1024, help="report the keys with a bucket this large apart")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a subprocess: this bucket set, its row as JSON on stdout
    parser.add_argument("--json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.one:
        row = run_one(tuple(int(b) for b in args.one.split(",")), lengths, args.trials, args.large)
        print(json.dumps(row))
        return
    rows = []
    for buckets in args.buckets:
        out = subprocess.run([sys.executable, __file__, "--one", buckets, "--lengths", args.lengths, "--trials",
                              str(args.trials), "--large", str(args.large)], stdout=subprocess.PIPE, text=True,
                             check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    import torch

    device = torch.cuda.get_device_name()
    print(f"\n{device}, DeepSeek-V2-Lite shape, random bf16 weights, TTFT ms (median of {args.trials})")
    print("| prompt tokens | " + " | ".join(f"{kind} {r['buckets']}" for kind in ("EXTEND", "MIXED") for r in rows)
          + " |")
    for n in lengths:
        cells = [f"{r[kind][str(n)]['ttft_ms']:.1f}" for kind in ("extend", "mixed") for r in rows]  # JSON keys
        print(f"| {n} | " + " | ".join(cells) + " |")
    for r in rows:
        print(f"{r['buckets']}: built in {r['build_s']:.1f} s, {r['keys']} keys ({r['large_keys']} with a bucket of "
              f"{args.large}+: run {r['large_keys_run_s']:.1f} s, capture {r['large_keys_capture_s']:.2f} s), all keys "
              f"run {r['keys_run_s']:.1f} s, graph pool {r['pool_mib']:.0f} MiB, {r['free_gib']:.2f} GiB free")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
