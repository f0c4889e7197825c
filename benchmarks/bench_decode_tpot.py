"""Decode TPOT on the DeepSeek-V2-Lite shape: encore (flashinfer and Triton attention, CUDA graphs) vs
the memory-bandwidth floor vs HF transformers' own DeepseekV2 on the same weights.

Weights: transformers' DeepseekV2ForCausalLM is built on the GPU from V2-Lite's config.json values
(random bf16, its own initializer, seed 0); encore's model shares those very tensors (experts, attention,
embeddings), so both run the same numbers — except each MoE layer's expert stacks, which the engine
copies when it fuses the shared experts into them on CUDA (same values). A greedy check on a short prompt
(argmax and logits error of encore vs transformers; the rank of transformers' pick among encore's logits,
and its lead over its second pick against the two models' largest logit difference, which tell a bf16
near-tie of random weights' flat logits from a wrong model) guards the name mapping.

encore: one ModelRunner per attention backend with CUDA-graph keys for decode bs 1/8/64 at q_len 1 and
q_len 4 (spec verify: 1 + k with k = 3); a step = plan + replay + logits of every row + greedy pick (the
model's ``greedy_tokens``, the argmax of the head's own output, as the engine's greedy heads take it),
timed with CUDA events around the whole step (host planning included), each row at ``context`` cached
tokens; the host's share of it (the call until it returns, the GPU idle before) is printed beside it,
and so is the step's time with the steps called back to back ("piped": each step's host part runs under
the GPU work of the steps before it, as the engine's overlapped steps run; ``pipelined_ms``).
Floor = bytes the step must read (weights touched under uniform routing + every row's latent KV) /
device-to-device copy bandwidth measured in the same run; the verify step has its own ("q4 floor"): its
4 tokens a row touch more experts (at bs 1 ~21 of 64 a layer against 6). transformers: ``generate`` (greedy, its default
dynamic cache): TPOT = (time for 1 + N new tokens − time for 1) / N, where it fits in memory.

``--profile-steps N`` also runs N steps of each shape under the torch profiler and prints, a row, each
kernel's share of the critical path at q_len 1 and 4 (``profile_decode_kernels``), largest increase first.

    python benchmarks/bench_decode_tpot.py [--contexts 1024,8192] [--batch-sizes 1,8,64] [--profile-steps 10]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time

import torch
from bench_decode_graphs import bytes_read, copy_bandwidth, decode_batch, floor_ms, pipelined_ms, step_times
from profile_decode_kernels import attribute, critical_path, differences, kernel_family, profiled_kernels

from encore.backends.metadata import ForwardBatch
from encore.engine.config import EngineConfig
from encore.engine.model_runner import ModelRunner
from encore.engine.step import pack_batch
from encore.models.config import ModelConfig
from encore.models.deepseek import DeepseekForCausalLM

PAGE_SIZE = 64
VERIFY_Q_LEN = 4
PROFILE_TOP = 25  # kernels printed a row with --profile-steps
# deepseek-ai/DeepSeek-V2-Lite config.json (the fields that shape compute).
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "bos_token_id": 100000, "eos_token_id": 100001,
    "tie_word_embeddings": False, "attention_bias": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "rope_theta": 10000,
}


def build_hf() -> torch.nn.Module:
    from transformers import AutoConfig, DeepseekV2ForCausalLM

    fields = {k: v for k, v in V2_LITE.items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model("deepseek_v2", **fields)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)  # the same weights every run
    try:
        with torch.device("cuda"):
            model = DeepseekV2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def encore_weights(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' in-memory names -> encore's (experts already stacked as [E, 2I, H] / [E, H, I])."""
    out, pending = {}, {}
    for name, tensor in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            out[name.replace("gate_up_proj", "w13")] = tensor
        elif name.endswith("mlp.experts.down_proj"):
            out[name.replace("down_proj", "w2")] = tensor
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "shared_experts.gate_proj.weight",
                            "shared_experts.up_proj.weight")):
            pending.setdefault(name.rsplit(".", 2)[0], {})[name.split(".")[-2]] = tensor
        elif ".experts." in name:
            raise RuntimeError(f"unexpected transformers expert tensor {name}: this bench maps stacked experts only")
        else:
            out[name] = tensor
    for module, parts in pending.items():
        out[f"{module}.gate_up_proj.weight"] = torch.cat([parts["gate_proj"], parts["up_proj"]])
    return out


def share_weights(weights: dict[str, torch.Tensor]):
    def build(cfg: ModelConfig, backend, device: torch.device, dtype: torch.dtype) -> DeepseekForCausalLM:
        with torch.device("meta"):
            model = DeepseekForCausalLM(cfg, backend)
        # transformers' tensors replace the meta parameters: nothing is allocated for them (materializing the
        # model first took a second 31 GB, and session 55's H100 ran out of memory)
        model.load_state_dict(weights, assign=True, strict=True)
        model.rotary.to_empty(device=device).init_buffers()  # its cos/sin table, the one buffer not shared
        return model.eval()

    return build


def make_runner(cfg: ModelConfig, backend: str, batch_sizes: list[int], context: int, weights) -> ModelRunner:
    rows = max(batch_sizes)
    pages_per_row = math.ceil((context + VERIFY_Q_LEN) / PAGE_SIZE)
    config = EngineConfig(model="random:deepseek-v2-lite", device="cuda", dtype="bfloat16",
                          attention_backend=backend, page_size=PAGE_SIZE, num_kv_pages=1 + rows * pages_per_row,
                          max_model_len=pages_per_row * PAGE_SIZE - VERIFY_Q_LEN, max_num_seqs=rows,
                          max_num_batched_tokens=rows * VERIFY_Q_LEN, graph_decode_sizes=tuple(batch_sizes),
                          graph_q_lens=(1, VERIFY_Q_LEN), graph_mixed_extends=(), graph_extend_sizes=())
    runner = ModelRunner(config, cfg, config.max_model_len, build_model=share_weights(weights))
    runner.prepare_graphs()
    for cache in runner.kv_caches:
        cache.normal_(0.0, 1.0)  # finite stand-ins for the rows' cached latents
    return runner


def prompt_batch(ids: torch.Tensor) -> ForwardBatch:
    """One prefill row of ``ids`` from position 0 on pages 1.."""
    n = ids.numel()
    table = list(range(1, 1 + math.ceil(n / PAGE_SIZE)))
    slots = [table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(n)]
    return pack_batch(1, 1, PAGE_SIZE, ids.tolist(), list(range(n)), slots, [n], [0], [0, n], [table], [n - 1],
                      ids.device)


@torch.inference_mode()
def greedy_check(runner: ModelRunner, hf: torch.nn.Module) -> dict:
    ids = (torch.arange(48, device="cuda") * 7919 + 11) % V2_LITE["vocab_size"]
    batch = prompt_batch(ids)
    mine = runner.model.compute_logits(runner.forward(batch, batch.gather_ids))[0]
    theirs = hf(ids[None]).logits[0, -1].float()
    top2 = theirs.topk(2).values
    # random weights give near-flat logits: where the picks differ, whether transformers' own lead is
    # within the two models' largest logit difference (bf16 rounding) tells a near-tie from a wrong model
    return {"argmax_equal": bool(mine.argmax() == theirs.argmax()),
            "logits_rel_err": ((mine - theirs).norm() / theirs.norm()).item(),
            "their_pick_rank_in_mine": int((mine > mine[theirs.argmax()]).sum()),
            "their_top2_gap": (top2[0] - top2[1]).item(), "logits_max_abs_diff": (mine - theirs).abs().max().item()}


@torch.inference_mode()
def encore_rows(runner: ModelRunner, batch_sizes: list[int], contexts: list[int], bandwidth: float, iters: int,
                profile_steps: int = 0) -> list[dict]:
    rows = []
    max_pages = runner.graphs.buffers.max_pages
    for context in contexts:
        for bs in batch_sizes:
            floor, verify_floor = (floor_ms(bytes_read(runner.model, runner.model.cfg, bs, context, q_len), bandwidth)
                                   for q_len in (1, VERIFY_Q_LEN))
            step_ms, host_ms, piped_ms, kernels = {}, {}, {}, {}
            for q_len in (1, VERIFY_Q_LEN):
                batch = decode_batch(bs, context, runner.device, q_len, PAGE_SIZE, max_pages)

                def step(batch=batch):
                    hidden = runner.forward(batch, batch.gather_ids)
                    return runner.model.greedy_tokens(hidden)

                before = runner.graph_stats()["graph_replays"]
                step_ms[q_len], host_ms[q_len] = step_times(step, iters)  # host: what overlapped steps hide
                piped_ms[q_len] = pipelined_ms(step, iters)  # steps back to back: the host's share hidden
                assert runner.graph_stats()["graph_replays"] > before, "the step did not replay a CUDA graph"
                if profile_steps:
                    # kernels by name alone: the two shapes launch other grids
                    kernels[q_len] = attribute(critical_path(profiled_kernels(step, profile_steps, grids=False)),
                                               profile_steps)
            row = {"engine": f"encore-{runner.backend.name}", "bs": bs, "context": context, "tpot_ms": step_ms[1],
                   "floor_ms": floor, "x_floor": step_ms[1] / floor, "throughput_vs_floor": floor / step_ms[1],
                   "verify_q4_ms": step_ms[VERIFY_Q_LEN], "verify_over_decode": step_ms[VERIFY_Q_LEN] / step_ms[1],
                   "verify_floor_ms": verify_floor, "verify_x_floor": step_ms[VERIFY_Q_LEN] / verify_floor,
                   "host_ms": host_ms[1], "verify_host_ms": host_ms[VERIFY_Q_LEN],
                   "pipelined_ms": piped_ms[1], "verify_pipelined_ms": piped_ms[VERIFY_Q_LEN],
                   "pipelined_verify_over_decode": piped_ms[VERIFY_Q_LEN] / piped_ms[1]}
            if profile_steps:
                row["verify_kernels"] = differences(kernels[1], kernels[VERIFY_Q_LEN], key=kernel_family)
                print(f"{row['engine']} bs {bs} x {context}, the verify step's kernels against the decode step's "
                      "(share of the critical path, µs a step):\n| kernel | q1 | q4 | delta |\n|---|---|---|---|")
                for r in row["verify_kernels"][:PROFILE_TOP]:
                    print(f"| {r['kernel'][:90]} | {r['share_us_before']} | {r['share_us_after']} | {r['delta_us']} |")
            rows.append(row)
    return rows


@torch.inference_mode()
def hf_rows(hf: torch.nn.Module, batch_sizes: list[int], contexts: list[int], new_tokens: int, max_tokens: int
            ) -> list[dict]:
    rows = []
    for context in contexts:
        for bs in batch_sizes:
            row = {"engine": "transformers", "bs": bs, "context": context}
            if bs * context > max_tokens:  # its cache holds decompressed K/V: 27·16·320 values per token
                rows.append({**row, "error": f"skipped (bs·ctx > {max_tokens})"})
                continue
            ids = (torch.arange(bs * context, device="cuda").view(bs, context) * 7919) % V2_LITE["vocab_size"]
            try:
                times = {}
                for n in (2, 1, 1 + new_tokens):  # the first call warms up (allocator, kernels): untimed
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
                    torch.cuda.synchronize()
                    times[n] = time.perf_counter() - start
                row["tpot_ms"] = (times[1 + new_tokens] - times[1]) / new_tokens * 1e3
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            gc.collect()
            torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--backends", default="flashinfer,triton")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--hf-new-tokens", type=int, default=8, help="0 skips transformers")
    ap.add_argument("--hf-max-tokens", type=int, default=64 * 1024, help="skip transformers above bs·context")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="also profile this many steps of each shape and compare the verify step's kernels")
    ap.add_argument("--json")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]

    hf = build_hf()
    weights = encore_weights(hf)
    cfg = ModelConfig.from_dict(V2_LITE)
    bandwidth = copy_bandwidth()
    rows, checks, prepare_s = [], {}, {}
    for backend in filter(None, args.backends.split(",")):
        start = time.perf_counter()
        runner = make_runner(cfg, backend, batch_sizes, max(contexts), weights)
        prepare_s[backend] = time.perf_counter() - start
        checks[backend] = greedy_check(runner, hf)
        backend_rows = encore_rows(runner, batch_sizes, contexts, bandwidth, args.iters, args.profile_steps)
        rows += backend_rows
        brief = [{k: v for k, v in r.items() if k != "verify_kernels"} for r in backend_rows]
        print(f"{backend}: prepared in {prepare_s[backend]:.1f}s, {checks[backend]}, rows {brief}", flush=True)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    if args.hf_new_tokens:
        rows += hf_rows(hf, batch_sizes, contexts, args.hf_new_tokens, args.hf_max_tokens)

    floors = {(r["bs"], r["context"]): r["floor_ms"] for r in rows if "floor_ms" in r}  # none without encore
    print(f"DeepSeek-V2-Lite shape, random bf16 weights, {torch.cuda.get_device_name()}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, page size {PAGE_SIZE}")
    print(f"greedy check vs transformers: {checks}; graph prepare s: "
          f"{ {k: round(v, 1) for k, v in prepare_s.items()} }")
    columns = {"TPOT ms": 9, "floor ms": 9, "x floor": 8, "verify q4 ms": 13, "q4/q1": 6, "q4 floor ms": 12,
               "q4 x floor": 11, "host q1/q4 ms": 14, "piped q1/q4 ms": 15, "piped q4/q1": 12}
    print(f"{'engine':<20} {'bs':>4} {'ctx':>6} " + " ".join(f"{title:>{width}}" for title, width in columns.items()))
    for r in rows:
        floor = floors.get((r["bs"], r["context"]))
        tpot = r.get("tpot_ms")
        cells = [f"{tpot:.3f}" if tpot else r.get("error", "-"), f"{floor:.3f}" if floor else "-",
                 f"{tpot / floor:.2f}" if tpot and floor else "-",
                 f"{r['verify_q4_ms']:.3f}" if "verify_q4_ms" in r else "-",
                 f"{r['verify_over_decode']:.2f}" if "verify_over_decode" in r else "-",
                 f"{r['verify_floor_ms']:.3f}" if "verify_floor_ms" in r else "-",
                 f"{r['verify_x_floor']:.2f}" if "verify_floor_ms" in r else "-",
                 f"{r['host_ms']:.3f}/{r['verify_host_ms']:.3f}" if "host_ms" in r else "-",
                 f"{r['pipelined_ms']:.3f}/{r['verify_pipelined_ms']:.3f}" if "pipelined_ms" in r else "-",
                 f"{r['pipelined_verify_over_decode']:.2f}" if "pipelined_ms" in r else "-"]
        print(f"{r['engine']:<20} {r['bs']:>4} {r['context']:>6} "
              + " ".join(f"{cell:>{width}}" for cell, width in zip(cells, columns.values(), strict=True)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "copy_bandwidth_Bps": bandwidth, "greedy_check": checks, "prepare_s": prepare_s,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
