"""Overlapped steps (``EngineConfig.overlap_schedule``): in-process decode TPOT and throughput of one
engine with its steps overlapped against the same engine stepping one step at a time, the setting
switched between interleaved trials (off, on, off, on, ...), so both see the machine in one state.

Each trial: ``bs`` requests of ``--context`` random prompt tokens (prefix caching off) and
``--max-tokens`` greedy tokens (``ignore_eos``), added at once and stepped to the end. Decode step:
the mean time between step calls once every request has its first token (each call then returns a
token of every row), the steady state a floor bounds; TPOT: per request, (last token's time - first
token's) / (tokens - 1), the median over requests (a request admitted early also waits through the
later prompts' steps); throughput: output tokens / the trial's wall time. The tokens of both settings
are compared (greedy: they must be equal).

Models: ``tiny`` (the embedded encore-tiny, bf16 on CUDA) and ``v2-lite`` (DeepSeek-V2-Lite's shape,
random bf16 weights made on the GPU: ``bench_decode_graphs.build_random``; its rows also get the
memory-bandwidth floor of a decode step at the trial's mean context: bytes read / copy bandwidth
measured in the same run, as ``bench_decode_tpot.py`` computes it).

    python benchmarks/bench_overlap.py [--model tiny] [--batch-sizes 1,8,64] [--context 1024]
        [--max-tokens 64] [--trials 5] [--attention-backend auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from encore.engine import Engine, SamplingParams


def random_v2_lite(**config) -> Engine:
    """An Engine of DeepSeek-V2-Lite's shape with random bf16 weights made on the GPU
    (``bench_decode_graphs.build_random``), pages of 64; ``config``: the rest of its EngineConfig."""
    from bench_decode_graphs import build_random
    from bench_decode_tpot import V2_LITE

    model_dir = Path(tempfile.mkdtemp(prefix="encore-v2-lite-config-"))
    (model_dir / "config.json").write_text(json.dumps(V2_LITE))
    return Engine(str(model_dir), device="cuda", dtype="bfloat16", build_model=build_random, page_size=64, **config)


def v2_lite_engine(batch_sizes: list[int], context: int, max_tokens: int, backend: str) -> Engine:
    return random_v2_lite(attention_backend=backend, max_model_len=context + max_tokens + 64, **options(batch_sizes))


def options(batch_sizes: list[int]) -> dict:
    """A DECODE key per batch size (a trial's decode steps are all of its size; its prompts' steps run
    without one), no prefix cache: both settings compute every prompt the same way (from the cache, a
    bf16 prompt's last token could differ)."""
    return dict(max_num_seqs=max(batch_sizes), graph_decode_sizes=tuple(batch_sizes), graph_mixed_extends=(),
                graph_extend_sizes=(), enable_prefix_caching=False)


def trial(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    ids = [f"r{i}" for i in range(len(prompts))]
    returns = []  # when each step call returned
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        returns.append(now)
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
            if out.finished:
                tokens[out.request_id] = out.token_ids
    wall = time.perf_counter() - start
    n = params.max_tokens
    tpot = statistics.median((last[r] - first[r]) / (n - 1) for r in ids) * 1e3
    ttft = statistics.median(first[r] - start for r in ids) * 1e3
    all_started = max(first.values())  # from here on every step call returns one token for every row
    decode_calls = [t for t in returns if t > all_started]
    step_ms = (decode_calls[-1] - all_started) / len(decode_calls) * 1e3
    return {"step_ms": step_ms, "tpot_ms": tpot, "ttft_ms": ttft, "tok_s": n * len(ids) / wall,
            "tokens": [tokens[r] for r in ids]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "v2-lite"), default="tiny")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.model == "tiny":
        engine = Engine(device="cuda", dtype="bfloat16", max_model_len=args.context + args.max_tokens + 16,
                        attention_backend=args.attention_backend, **options(batch_sizes))
        bandwidth = None
    else:
        from bench_decode_graphs import V2_LITE, bytes_read, copy_bandwidth, floor_ms

        # Before the engine: its KV pool takes most of the memory left, and on an H100 the copy's 2 GiB
        # no longer fit after it. A second of copies first brings the idle GPU's clocks up.
        bandwidth = copy_bandwidth(warm_up_s=1.0)
        torch.cuda.empty_cache()
        engine = v2_lite_engine(batch_sizes, args.context, args.max_tokens, args.attention_backend)
    device = torch.cuda.get_device_name()
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for bs in batch_sizes:
        def prompts() -> list[list[int]]:
            return [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(bs)]

        for overlap in (False, True):  # warm-up: this batch size's shapes, both ways
            engine.overlap_schedule = overlap
            trial(engine, prompts(), params)
        results = {False: [], True: []}
        for _ in range(args.trials):
            batch = prompts()
            for overlap in (False, True):
                engine.overlap_schedule = overlap
                results[overlap].append(trial(engine, batch, params))
        same = all(a["tokens"] == b["tokens"] for a, b in zip(results[False], results[True]))
        row = {"bs": bs, "context": args.context, "same_tokens": same,
               "trials": {name: [{k: v for k, v in r.items() if k != "tokens"} for r in results[overlap]]
                          for overlap, name in ((False, "off"), (True, "on"))}}
        for overlap, name in ((False, "off"), (True, "on")):
            for metric in ("step_ms", "tpot_ms", "ttft_ms", "tok_s"):
                row[f"{name}_{metric}"] = statistics.median(r[metric] for r in results[overlap])
        row["step_ratio"] = row["on_step_ms"] / row["off_step_ms"]
        row["tpot_ratio"] = row["on_tpot_ms"] / row["off_tpot_ms"]
        row["tok_s_ratio"] = row["on_tok_s"] / row["off_tok_s"]
        if bandwidth is not None:
            need = bytes_read(engine.runner.model, V2_LITE, bs, args.context + args.max_tokens // 2)
            row["floor_ms"] = floor_ms(need, bandwidth)
            row["off_floor_fraction"] = row["floor_ms"] / row["off_step_ms"]
            row["on_floor_fraction"] = row["floor_ms"] / row["on_step_ms"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trials"}), flush=True)
    stats = engine.stats()
    backend = engine.runner.backend.name
    if stats["attention_triton_decode_steps"]:  # "auto" on flashinfer: q_len-1 decode steps on Triton
        backend += f", {stats['attention_triton_decode_steps']} steps' decode rows on Triton"
    print(f"\n{device}, {args.model} ({backend} attention), context {args.context}, {args.max_tokens} tokens, "
          f"medians of {args.trials} trials; eager steps {stats['eager_steps']}, kernel compiles "
          f"{stats['kernel_compiles']}")
    floor = " floor ms |" if bandwidth is not None else ""
    print(f"| bs |{floor} decode step off / on ms | on / off | TPOT off / on ms | TTFT off / on ms | tok/s off / on "
          f"| on / off | same tokens |")
    for r in rows:
        cell = f" {r['floor_ms']:.2f} |" if bandwidth is not None else ""
        print(f"| {r['bs']} |{cell} {r['off_step_ms']:.3f} / {r['on_step_ms']:.3f} | {r['step_ratio']:.3f} | "
              f"{r['off_tpot_ms']:.3f} / {r['on_tpot_ms']:.3f} | {r['off_ttft_ms']:.1f} / {r['on_ttft_ms']:.1f} | "
              f"{r['off_tok_s']:.0f} / {r['on_tok_s']:.0f} | {r['tok_s_ratio']:.3f} | {r['same_tokens']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "model": args.model, "backend": backend,
                                               "args": vars(args), "copy_bandwidth": bandwidth, "stats": stats,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
