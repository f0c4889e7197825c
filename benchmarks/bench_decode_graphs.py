"""Decode step time on a DeepSeek-V2-Lite-shaped model: eager vs compiled vs CUDA-graph replay.

The model is built from a ModelConfig directly on the GPU with random bf16 weights (27 layers, 64
routed experts top-6 + 2 shared, MLA 512 + 64; no checkpoint, no download). For each batch size a
decode step at ``--context`` tokens per row (forward + logits of every row, the "auto" attention backend)
is timed three ways, each next to its floor: the bytes a step must read — the weights it touches
(all dense weights, the routed experts the batch is expected to hit under uniform routing, the LM
head) plus every row's latent KV — over the device-to-device copy bandwidth measured in the same run.
Also measured, each in a fresh process: a cold warm-up (compile + capture of every key into an empty
graph cache) and a warm start to ready (same cache: the families load precompiled, graphs are
recaptured), each split into imports, building the model (random weights, KV cache, kernel warm-up)
and preparing the keys. Python's bytecode cache is kept under the graph cache (PYTHONPYCACHEPREFIX):
the cold run writes it, as installing a package does, and the warm start reads it. A second warm
start runs with PYTHONDONTWRITEBYTECODE=1 and no prefix, which is what a machine whose Python
packages ship without bytecode pays on every start.

    python benchmarks/bench_decode_graphs.py [--batch-sizes 1,64] [--context 1024] [--iters 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

START = time.perf_counter()  # "time to ready" counts imports too

import torch  # noqa: E402

from encore.backends.base import AttentionBackend  # noqa: E402
from encore.backends.metadata import ForwardBatch  # noqa: E402
from encore.engine.config import EngineConfig  # noqa: E402
from encore.engine.model_runner import ModelRunner  # noqa: E402
from encore.engine.step import pack_batch  # noqa: E402
from encore.models.config import ModelConfig, RopeConfig  # noqa: E402
from encore.models.deepseek import DeepseekForCausalLM  # noqa: E402

PAGE_SIZE = 16

V2_LITE = ModelConfig(
    architecture="DeepseekV2ForCausalLM", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, scoring_func="softmax", topk_method="greedy",
    n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    rope=RopeConfig(kind="yarn", theta=10000.0, dim=64, factor=40.0, original_max_position_embeddings=4096,
                    beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
    attention_bias=False, tie_word_embeddings=False, num_nextn_predict_layers=0, bos_token_id=100000,
    eos_token_ids=(100001,),
)


def build_random(cfg: ModelConfig, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype) -> DeepseekForCausalLM:
    """Random weights made on the GPU: norms 1, everything else N(0, 0.02)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, backend)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.rotary.init_buffers()
    return model.eval()


def engine_config(batch_sizes: list[int], context: int, cache_dir: str, all_keys: bool) -> EngineConfig:
    """Decode keys for ``batch_sizes`` only, or (``all_keys``) the engine's default key set: DECODE,
    MIXED and EXTEND buckets as ``encore serve`` captures them."""
    rows = max(batch_sizes)
    pages_per_row = math.ceil((context + 1) / PAGE_SIZE)
    keys = {} if all_keys else dict(max_num_batched_tokens=max(rows, 16), graph_decode_sizes=tuple(batch_sizes),
                                    graph_mixed_extends=(), graph_extend_sizes=())
    return EngineConfig(model="random:deepseek-v2-lite", device="cuda", dtype="bfloat16", page_size=PAGE_SIZE,
                        num_kv_pages=1 + rows * pages_per_row, max_model_len=pages_per_row * PAGE_SIZE,
                        max_num_seqs=rows, graph_cache_dir=cache_dir, **keys)


def make_runner(batch_sizes: list[int], context: int, cache_dir: str, all_keys: bool = False
                ) -> tuple[ModelRunner, dict]:
    """The runner with every key prepared, and how long building it and preparing the keys took."""
    config = engine_config(batch_sizes, context, cache_dir, all_keys)
    begin = time.perf_counter()
    runner = ModelRunner(config, V2_LITE, config.max_model_len, build_model=build_random)
    built = time.perf_counter()
    reports = runner.prepare_graphs()
    torch.cuda.synchronize()
    timings = {"build_s": built - begin, "prepare_s": time.perf_counter() - built,
               "pool_mib": sum(r.pool_bytes for r in reports) / 2**20,
               "keys": [{"key": str(r.key), "compile_s": r.compile_s, "capture_s": r.capture_s,
                         "pool_mib": r.pool_bytes / 2**20} for r in reports]}
    return runner, timings


def decode_batch(bs: int, context: int, device: torch.device, q_len: int = 1, page_size: int = PAGE_SIZE,
                 max_pages: int | None = None) -> ForwardBatch:
    """Every row at ``context`` cached tokens, feeding ``q_len`` new ones; row b owns ``max_pages``
    pages (default: just enough) from 1 + b·max_pages on."""
    max_pages = max_pages or math.ceil((context + q_len) / page_size)
    tables = [list(range(1 + b * max_pages, 1 + (b + 1) * max_pages)) for b in range(bs)]
    positions = list(range(context, context + q_len)) * bs
    slots = [t[p // page_size] * page_size + p % page_size for t in tables for p in range(context, context + q_len)]
    tokens = bs * q_len
    return pack_batch(0, q_len, page_size, [(t * 7919) % V2_LITE.vocab_size for t in range(tokens)], positions,
                      slots, [context + q_len] * bs, [context] * bs, list(range(0, tokens + 1, q_len)), tables,
                      list(range(tokens)), device)


def step_times(step, iters: int) -> tuple[float, float]:
    """Medians in ms of ``step`` between CUDA events around it, and of its call on the host until it returns
    (plan, uploads, launches): each step starts on an idle GPU, so the host part is on its critical path."""
    for _ in range(3):
        step()
    times, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        called = time.perf_counter()
        start.record()
        step()
        host.append((time.perf_counter() - called) * 1e3)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), statistics.median(host)


def pipelined_ms(step, iters: int) -> float:
    """Mean ms a step of ``iters`` steps called back to back with no wait between them: each step's host
    part (plan, uploads, launches) runs while the GPU runs the steps before it, as the engine's overlapped
    steps do, so where the GPU's share is the larger one this is the GPU's time a step. The start event
    follows a lead step's launches, so the first timed step's host part runs under the lead's GPU work."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def time_ms(step, iters: int) -> float:
    return step_times(step, iters)[0]


def copy_bandwidth(nbytes: int = 1 << 30, warm_up_s: float = 0.0) -> float:
    """Bytes moved per second by a device-to-device copy (read + write), after copying for ``warm_up_s``
    seconds first (a GPU that has been idle measures low until its clocks come up)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    deadline = time.perf_counter() + warm_up_s
    while time.perf_counter() < deadline:
        dst.copy_(src)
        torch.cuda.synchronize()
    ms = time_ms(lambda: dst.copy_(src), 20)
    return 2 * nbytes / (ms / 1e3)


def bytes_read(model: DeepseekForCausalLM, cfg: ModelConfig, bs: int, context: int, q_len: int = 1
               ) -> dict[str, float]:
    """What a decode step of ``bs`` rows of ``q_len`` tokens each (a verify step: q_len > 1) must read:
    weights its tokens touch under uniform routing and the rows' latent KV."""
    tokens = bs * q_len
    expected_experts = cfg.n_routed_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** tokens)
    weights = 0.0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if name.endswith("embed_tokens.weight"):
            size = tokens * param.shape[1] * param.element_size()  # only the rows looked up
        elif ".experts.w" in name:  # with shared experts fused, the stack's last ones are read every step
            size = size / param.shape[0] * (expected_experts + param.shape[0] - cfg.n_routed_experts)
        weights += size
    kv = bs * (context + q_len) * cfg.latent_dim * 2 * cfg.num_hidden_layers
    return {"weights": weights, "kv": kv, "expected_experts_per_layer": expected_experts}


def floor_ms(need: dict[str, float], bandwidth: float) -> float:
    """A step's memory-bandwidth floor: the bytes ``bytes_read`` says it must read at ``bandwidth`` B/s."""
    return (need["weights"] + need["kv"]) / bandwidth * 1e3


@torch.inference_mode()
def measure(runner: ModelRunner, bs: int, context: int, iters: int) -> dict[str, float]:
    model, graphs = runner.model, runner.graphs
    batch = decode_batch(bs, context, runner.device)
    key = graphs.table.find(batch)
    assert key is not None and key.bs == bs, (bs, key)

    def eager():
        with runner.context.bind(batch):
            runner.backend.plan(batch)
            hidden = model(batch.input_ids, batch.positions, batch)
        return model.compute_logits(hidden[batch.gather_ids])

    def compiled():
        padded = graphs.buffers.fill(key, batch)
        with runner.context.bind(padded):
            runner.backend.plan(padded, static=True)
            hidden = graphs.compiled(key, padded)
        return model.compute_logits(hidden[padded.gather_ids])

    def replay():
        return model.compute_logits(runner.forward(batch, batch.gather_ids))

    results = {name: time_ms(fn, iters) for name, fn in (("eager", eager), ("compiled", compiled),
                                                          ("cuda_graph", replay))}
    want, got = eager().float(), replay().float()
    results["replay_vs_eager_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
    return results


def prepare_in_fresh_process(batch_sizes: list[int], context: int, cache_dir: str, all_keys: bool,
                             bytecode_cache: bool) -> dict:
    """``bytecode_cache``: Python reads and writes bytecode under ``cache_dir``; else it writes none."""
    command = [sys.executable, __file__, "--phase", "prepare", "--cache-dir", cache_dir, "--context", str(context),
               "--batch-sizes", ",".join(map(str, batch_sizes))] + (["--all-keys"] if all_keys else [])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    if bytecode_cache:
        env["PYTHONPYCACHEPREFIX"] = os.path.join(cache_dir, "pycache")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout  # stderr: ours
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cache-dir", default=None, help="graph cache root (default: a fresh temporary directory)")
    ap.add_argument("--all-keys", action="store_true", help="warm up the engine's default key set, not only "
                    "decode keys for --batch-sizes")
    ap.add_argument("--phase", choices=("all", "prepare"), default="all", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    if args.phase == "prepare":  # child: build, compile, capture; report the time to ready
        imports_s = time.perf_counter() - START
        runner, timings = make_runner(batch_sizes, args.context, args.cache_dir, args.all_keys)
        stats = runner.graph_stats()
        print(json.dumps({"ready_s": time.perf_counter() - START, "imports_s": imports_s, **timings,
                          "compiled_keys": stats["compiled_keys"], "loaded_graphs": stats["loaded_graphs"],
                          "compiled_graphs": stats["compiled_graphs"]}))
        return

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="encore_graph_cache_")
    cold = prepare_in_fresh_process(batch_sizes, args.context, cache_dir, args.all_keys, bytecode_cache=True)
    warm = prepare_in_fresh_process(batch_sizes, args.context, cache_dir, args.all_keys, bytecode_cache=True)
    warm_no_bytecode = prepare_in_fresh_process(batch_sizes, args.context, cache_dir, args.all_keys,
                                                bytecode_cache=False)
    runner, _ = make_runner(batch_sizes, args.context, cache_dir, args.all_keys)
    for cache in runner.kv_caches:
        cache.normal_(0.0, 1.0)  # finite stand-ins for the rows' cached latents
    bandwidth = copy_bandwidth()
    rows = []
    for bs in batch_sizes:
        times = measure(runner, bs, args.context, args.iters)
        need = bytes_read(runner.model, V2_LITE, bs, args.context)
        floor = floor_ms(need, bandwidth)
        for mode in ("eager", "compiled", "cuda_graph"):
            rows.append({"mode": mode, "bs": bs, "context": args.context, "ms": times[mode], "floor_ms": floor,
                         "x_floor": times[mode] / floor, "tokens_per_s": bs / (times[mode] / 1e3),
                         "weights_gb": need["weights"] / 1e9, "kv_gb": need["kv"] / 1e9,
                         "replay_vs_eager_rel_err": times["replay_vs_eager_rel_err"]})

    print(f"DeepSeek-V2-Lite shape, random bf16 weights, {runner.backend.name} attention backend, "
          f"{torch.cuda.get_device_name()}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'mode':<11} {'bs':>4} {'ms/step':>9} {'floor ms':>9} {'x floor':>8} {'tok/s':>9} {'weights GB':>11} "
          f"{'KV GB':>7}")
    for r in rows:
        print(f"{r['mode']:<11} {r['bs']:>4} {r['ms']:>9.3f} {r['floor_ms']:>9.3f} {r['x_floor']:>8.2f} "
              f"{r['tokens_per_s']:>9.0f} {r['weights_gb']:>11.2f} {r['kv_gb']:>7.3f}")
    for label, start in (("cold warm-up (fresh process, empty cache)", cold),
                         ("warm start (same cache, fresh process)", warm),
                         ("warm start, no bytecode written or found", warm_no_bytecode)):
        keys = start["keys"]
        slowest = max(keys, key=lambda k: k["compile_s"] + k["capture_s"])
        print(f"{label}: ready in {start['ready_s']:.1f}s = imports {start['imports_s']:.1f}s + build "
              f"{start['build_s']:.1f}s + {len(keys)} keys {start['prepare_s']:.1f}s (first calls "
              f"{sum(k['compile_s'] for k in keys):.1f}s, captures {sum(k['capture_s'] for k in keys):.1f}s; "
              f"slowest {slowest['key']} {slowest['compile_s']:.1f}s + {slowest['capture_s']:.2f}s; graph pool "
              f"{start['pool_mib']:.0f} MiB); "
              f"graphs compiled {start['compiled_graphs']}, loaded {start['loaded_graphs']}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_Bps": bandwidth,
              "rows": rows, "cold_warmup": cold, "warm_start": warm, "warm_start_no_bytecode": warm_no_bytecode,
              "cache_dir": cache_dir}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
