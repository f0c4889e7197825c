"""Speculative decoding on the GPU: verify-step cost and end-to-end tokens/s.

A. DeepSeek-V2-Lite shape (random bf16 weights on the GPU, the "auto" attention backend, CUDA graphs):
   one verify step (q_len 1 + k) vs one plain decode step, at bs 1 and 16, context 1024.
B. encore-tiny end to end (``--dtype``, float32 by default; CUDA graphs, greedy, 96 tokens per request)
   at bs 1 and 16: plain decoding (the peer), real MTP drafting with k = 1..4, and the replaying test
   drafter at per-draft error rates 0.5 / 0.3 / 0.1 — synthetic acceptance by construction — with
   k = 1..4. The replay drafter needs float32: it replays the plain run's tokens, and in bf16 a verify
   step's numerics differ from a decode step's, so the target soon leaves the replayed continuation and
   acceptance collapses. Real MTP needs no such thing: ``--methods mtp --dtype bfloat16`` measures it
   in the checkpoint's own dtype. A batch size's engines are all built first and then timed in rounds,
   one generate call each in turn; a speedup is the median of its rounds' ratios to the plain call of
   the same round. The prompts rotate from round to round (all engines of a round run the same ones),
   so at bs 1 each of the four prompts is continued in turn.

    python benchmarks/bench_spec.py [--skip-v2-lite] [--methods mtp,replay] [--compile] [--dtype float32]
        [--repeats 15] [--model DIR] [--batch-sizes 1,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from bench_decode_graphs import PAGE_SIZE, V2_LITE, build_random, decode_batch, time_ms
from encore.engine import Engine, SamplingParams
from encore.engine.config import EngineConfig
from encore.engine.model_runner import ModelRunner
from encore.server.engine_worker import freeze_start_up_heap

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, item):\n",
           "for i in range(10):\n"]
KEYS = dict(graph_decode_sizes=(1, 16), graph_mixed_decode_sizes=(16,), graph_prefill_tokens=(256,),
            graph_extend_sizes=(1,), graph_mixed_extends=(1,))


@torch.inference_mode()
def verify_vs_decode(context: int, iters: int) -> list[dict]:
    rows = []
    pages = math.ceil((context + 8) / PAGE_SIZE)
    config = EngineConfig(model="random:deepseek-v2-lite", device="cuda", dtype="bfloat16", page_size=PAGE_SIZE,
                          num_kv_pages=1 + 16 * pages, max_model_len=pages * PAGE_SIZE, max_num_seqs=16,
                          max_num_batched_tokens=64, compile=False, graph_decode_sizes=(1, 16),
                          graph_q_lens=(1, 2, 3, 4, 5), graph_mixed_extends=(), graph_extend_sizes=())
    runner = ModelRunner(config, V2_LITE, config.max_model_len, build_model=build_random)
    runner.prepare_graphs()
    for bs in (1, 16):
        base = None
        for q_len in (1, 2, 3, 4, 5):
            batch = decode_batch(bs, context, runner.device, q_len)
            ms = time_ms(lambda: runner.model.compute_logits(runner.forward(batch, batch.gather_ids)), iters)
            base = base or ms
            rows.append({"bs": bs, "q_len": q_len, "ms": round(ms, 3), "x_decode": round(ms / base, 3)})
    return rows


def round_prompts(bs: int, round_: int) -> list[str]:
    """A round's prompts: every engine runs the same ones in a round; from round to round they rotate, so
    bs 1 goes through each of PROMPTS in turn (one prompt's continuation is one small sample of drafting)."""
    return [PROMPTS[(round_ + i) % len(PROMPTS)] for i in range(bs)]


class Timed:
    """One engine and its requests, timed generate call by generate call. Every engine of a batch size
    is built and warmed up first, then the timed calls go round the engines in turn, so each round
    compares them under the same host conditions (this host-bound model's tokens/s moves by up to
    30 % between minutes of one machine)."""

    def __init__(self, bs: int, speculative: dict | None, max_tokens: int, compile_: bool, dtype: str,
                 model: str | None) -> None:
        # A fixed pool (a request's 512 tokens for each row, and the dummy page): the default sizes
        # the pool from the memory left free, which the engines built first would take.
        self.engine = Engine(model=model, device="cuda", dtype=dtype, compile=compile_, cuda_graphs=True,
                             max_model_len=512, num_kv_pages=1 + bs * 512 // 16, speculative=speculative, **KEYS)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.bs = bs
        self.tokens_per_call = bs * max_tokens
        self.rates: list[float] = []
        # One untimed call: a graph's first replay pays its upload; eager prefill kernels JIT-compile per shape.
        self.tokens = {o.request_id: o.token_ids for o in self.engine.generate(round_prompts(bs, 0), self.params)}

    def time_call(self, round_: int) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = self.engine.generate(round_prompts(self.bs, round_), self.params)
        self.rates.append(self.tokens_per_call / (time.perf_counter() - start))
        self.tokens.update((o.request_id, o.token_ids) for o in outs)


def end_to_end(max_tokens: int, methods: list[str], compile_: bool, dtype: str, repeats: int, model: str | None,
               batch_sizes: list[int]) -> list[dict]:
    """Per batch size: the plain engine (the peer) and one engine per drafter and k, timed in ``repeats``
    rounds of one generate call each; a row's tokens/s is its median over the rounds and its speedup
    the median of its per-round ratios to the plain engine's call of the same round."""
    rows = []
    for bs in batch_sizes:
        # Every engine here runs the same generate calls, so a request id names the same row in each,
        # and the replaying drafter replays the plain run's tokens under it.
        plain = Timed(bs, None, max_tokens + 8, compile_, dtype, model)
        configs = ([("mtp", None)] if "mtp" in methods else []) + (
            [("replay", e) for e in (0.5, 0.3, 0.1)] if "replay" in methods else [])
        specs = []
        for method, error in configs:
            for k in (1, 2, 3, 4):
                spec = {"method": method, "num_speculative_tokens": k}
                if method == "replay":
                    spec.update(continuations=plain.tokens, error_rate=error)
                label = "mtp" if method == "mtp" else f"replay err {error}"
                specs.append((label, k, Timed(bs, spec, max_tokens, compile_, dtype, model)))
        freeze_start_up_heap()  # as the server's engine process does: no timed call walks the engines' build garbage
        for round_ in range(repeats):
            plain.time_call(round_)
            for _, _, timed in specs:
                timed.time_call(round_)
        rows.append({"bs": bs, "drafter": "none", "k": 0, "tok_s": round(statistics.median(plain.rates), 1),
                     "speedup": 1.0, "acceptance": None, "tok_s_per_round": [round(r) for r in plain.rates]})
        for label, k, timed in specs:
            stats = timed.engine.stats()
            ratios = [r / p for r, p in zip(timed.rates, plain.rates)]
            rows.append({"bs": bs, "drafter": label, "k": k, "tok_s": round(statistics.median(timed.rates), 1),
                         "speedup": round(statistics.median(ratios), 2),
                         "speedup_range": [round(min(ratios), 2), round(max(ratios), 2)],
                         "speedup_per_round": [round(r, 3) for r in ratios],
                         "tok_s_per_round": [round(r) for r in timed.rates],
                         "acceptance": round(stats["spec_acceptance_rate"], 3),
                         "mean_accepted_len": round(stats["spec_mean_accepted_length"], 2),
                         "drafter_graph_replays": stats["drafter_graph_replays"],
                         "drafter_eager_steps": stats["drafter_eager_steps"],
                         "drafter_compiles": stats["drafter_compiles"]})
        del plain, specs
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--skip-v2-lite", action="store_true")
    ap.add_argument("--methods", default="mtp,replay", help="drafters of part B: mtp, replay")
    ap.add_argument("--compile", action="store_true", help="part B with compiled graphs (target and drafter)")
    ap.add_argument("--dtype", default="float32", help="part B's dtype; the replay drafter needs float32 "
                    "(module docstring), real MTP runs in the checkpoint's bfloat16 too")
    ap.add_argument("--repeats", type=int, default=15, help="rounds of timed generate calls in part B (median)")
    ap.add_argument("--model", default=None, help="part B's checkpoint directory (default: encore-tiny)")
    ap.add_argument("--batch-sizes", default="1,16", help="part B's batch sizes")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}")
    a = [] if args.skip_v2_lite else verify_vs_decode(args.context, args.iters)
    if a:
        print(f"A. V2-Lite shape, context {args.context}: verify step vs decode step (torch backend, CUDA graphs)")
        print(f"{'bs':>3} {'q_len':>5} {'ms':>8} {'x decode':>9}")
        for r in a:
            print(f"{r['bs']:>3} {r['q_len']:>5} {r['ms']:>8} {r['x_decode']:>9}")
    b = end_to_end(args.max_tokens, args.methods.split(","), args.compile, args.dtype, args.repeats, args.model,
                   [int(bs) for bs in args.batch_sizes.split(",")])
    print(f"B. encore-tiny end to end, {args.dtype}, greedy, CUDA graphs, compile={args.compile} "
          "(replay acceptance is synthetic)")
    print(f"{'bs':>3} {'drafter':>16} {'k':>2} {'tok/s':>9} {'speedup':>8} {'range':>12} {'accept':>7} {'mean len':>8}")
    for r in b:
        spread = "-".join(map(str, r["speedup_range"])) if "speedup_range" in r else ""
        print(f"{r['bs']:>3} {r['drafter']:>16} {r['k']:>2} {r['tok_s']:>9} {r['speedup']:>8} {spread:>12} "
              f"{str(r['acceptance']):>7} {str(r.get('mean_accepted_len', '')):>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "compile": args.compile, "dtype": args.dtype,
                       "verify_vs_decode": a, "end_to_end": b}, f, indent=2)


if __name__ == "__main__":
    main()
