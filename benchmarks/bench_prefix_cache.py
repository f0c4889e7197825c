"""Prefix caching: a burst of requests that share a long system prompt, with the cache on and off.

Each request is the same ``--shared-tokens`` system prompt plus ``--question-tokens`` of its own
(random token ids, new ones every trial, so a trial finds only the system prompt in the cache), and
generates ``--max-tokens`` greedy tokens. Both engines (same checkpoint and options, prefix caching on
and off — the peer) first run one such request, as a server would have served earlier traffic; then
the trials take turns (on, off, on, ...), all ``--clients`` requests added at once. With ``--cold``
every trial has a system prompt of its own and nothing is run before: the burst finds nothing cached,
and the first request computes the shared pages while the others wait for them. TTFT is from the
burst's submission to a request's first token, throughput all output tokens over the time to the
last; "computed" counts the prompt tokens the engine ran through the model (admitted minus cached).

    python benchmarks/bench_prefix_cache.py [--model DIR] [--device cuda] [--dtype bfloat16]
        [--clients 64] [--shared-tokens 1024] [--question-tokens 32] [--max-tokens 32] [--trials 3]
        [--cold] [--no-compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from encore.engine import Engine, SamplingParams
from encore.server.engine_worker import freeze_start_up_heap


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def trial(engine: Engine, tag: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    before = engine.stats()
    synchronize(engine.config.device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    end, tokens = start, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            tokens += len(out.new_token_ids)
            end = now
    after = engine.stats()
    ttft = sorted(1e3 * (t - start) for t in first.values())
    queried = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    return {"ttft_ms_mean": statistics.mean(ttft), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_max": ttft[-1],
            "wall_s": end - start, "throughput_tok_s": tokens / (end - start),
            "prompt_tokens": sum(map(len, prompts)), "computed_prompt_tokens": queried - hits,
            "steps": {m: after["steps"][m] - before["steps"][m] for m in after["steps"]},
            "recompiles": after.get("recompiles", 0) - before.get("recompiles", 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="checkpoint directory (default: the embedded encore-tiny)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--shared-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="a new system prompt every trial, none served before")
    ap.add_argument("--no-compile", action="store_true", help="CUDA graphs of the eager model, no torch.compile")
    ap.add_argument("--json")
    args = ap.parse_args()

    options = dict(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.clients,
                   max_model_len=args.shared_tokens + args.question_tokens + args.max_tokens + 16)
    if args.no_compile:
        options["compile"] = False
    engines = {"prefix cache on": Engine(**options), "off (peer)": Engine(enable_prefix_caching=False, **options)}
    freeze_start_up_heap()
    vocab = next(iter(engines.values())).model_config.vocab_size
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    shared = tokens(args.shared_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if not args.cold:
        primer = [shared + tokens(args.question_tokens)]
        for engine in engines.values():  # earlier traffic: the system prompt is in the on-engine's cache
            engine.generate(primer, params)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for t in range(args.trials):
        if args.cold:
            shared = tokens(args.shared_tokens)
        prompts = [shared + tokens(args.question_tokens) for _ in range(args.clients)]  # the same on both sides
        for name, engine in engines.items():
            runs[name].append(trial(engine, f"t{t}", prompts, params))

    rows = []
    for name, trials in runs.items():
        rows.append({"path": name, **{k: statistics.median(r[k] for r in trials)
                                      for k in trials[0] if k not in ("steps", "recompiles")},
                     "recompiles": sum(r["recompiles"] for r in trials), "trials": trials})
    on, off = rows
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{device}, {args.dtype}, {args.clients} requests x ({args.shared_tokens} shared + {args.question_tokens} "
          f"own) prompt tokens, {args.max_tokens} output tokens, {'cold' if args.cold else 'system prompt cached'}, "
          f"median of {args.trials} trials")
    print(f"{'path':18} {'TTFT mean':>10} {'p50':>8} {'max':>8} {'tok/s':>9} {'wall s':>8} {'computed':>9}")
    for r in rows:
        print(f"{r['path']:18} {r['ttft_ms_mean']:>10.1f} {r['ttft_ms_p50']:>8.1f} {r['ttft_ms_max']:>8.1f} "
              f"{r['throughput_tok_s']:>9.0f} {r['wall_s']:>8.3f} {r['computed_prompt_tokens']:>9.0f}")
    print(f"on / off: TTFT x{on['ttft_ms_mean'] / off['ttft_ms_mean']:.3f}, "
          f"throughput x{on['throughput_tok_s'] / off['throughput_tok_s']:.2f}; "
          f"recompiles in the trials: on {on['recompiles']}, off {off['recompiles']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
