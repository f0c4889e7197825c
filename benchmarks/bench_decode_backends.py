"""A layer's decode attention on each backend as the engine runs it: the Triton backend and flashinfer
(``attention_backend="flashinfer"``), each through its ``decode`` with a static plan (a graph key's),
captured in one CUDA graph: q_nope·W_kc, the MLA kernel over the paged latent cache, ·W_vc.
DeepSeek-V2-Lite's attention (H 16, latent 512 + 64, bf16, pages of 64). The page table is as wide as
an engine's ``max_model_len`` makes it (``GRID``: 2k and 32k tokens), since the Triton kernel's splits
follow that width; every row holds ``context`` keys (``bench_decode_graphs.decode_batch``). The calls of one graph cycle through copies of the cache,
together several times the L2, so each reads its KV from HBM as a model step does. Session 55 chose
``flashinfer_backend.SMALL_DECODE_TOKENS`` from it; the engine's own steps (``bench_decode_tpot.py``,
session 57) moved every q_len-1 decode step to the Triton kernel, which this kernel-only view misses.

    python benchmarks/bench_decode_backends.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from bench_decode_graphs import decode_batch
from bench_mla_decode import COLD_BYTES, graph_time_us
from encore.backends.base import MLADims

DIMS = MLADims(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
               softmax_scale=192 ** -0.5)
PAGE = 64
# (table width in tokens, contexts): a tight table, and a 32k one at short and long contexts.
GRID = ((2048, (512, 1024, 1920)), (32768, (1024, 8192, 32640)))
MAX_KEYS = 64 * 8192  # rows × context per case


def measure(bs: int, q_len: int, context: int, width_tokens: int) -> dict:
    from encore.backends.flashinfer_backend import FlashInferAttentionBackend
    from encore.backends.triton_backend import TritonAttentionBackend

    # Row b owns the table's pages 1 + b·width.. (page 0: the dummy page) and holds ``context`` keys, the
    # q_len new ones included; enough copies of the cache that the keys the calls read exceed the L2.
    width = width_tokens // PAGE
    batch = decode_batch(bs, context - q_len, torch.device("cuda"), q_len, PAGE, width)
    read = bs * -(-context // PAGE) * PAGE * DIMS.latent_dim * 2
    copies = max(2, min(32, math.ceil(COLD_BYTES / read)))
    caches = [torch.randn(1 + bs * width, PAGE, DIMS.latent_dim, device="cuda", dtype=torch.bfloat16)
              for _ in range(copies)]
    tokens = bs * q_len
    q_nope = torch.randn(tokens, DIMS.num_heads, DIMS.qk_nope_head_dim, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(tokens, DIMS.num_heads, DIMS.qk_rope_head_dim, device="cuda", dtype=torch.bfloat16)
    w_kc = torch.randn(DIMS.num_heads, DIMS.qk_nope_head_dim, DIMS.kv_lora_rank, device="cuda",
                       dtype=torch.bfloat16) * DIMS.kv_lora_rank ** -0.5
    w_vc = torch.randn(DIMS.num_heads, DIMS.v_head_dim, DIMS.kv_lora_rank, device="cuda",
                       dtype=torch.bfloat16) * DIMS.kv_lora_rank ** -0.5
    row = {"bs": bs, "q_len": q_len, "context": context, "width": width_tokens}
    outs = {}
    for name, cls in (("triton", TritonAttentionBackend), ("flashinfer", FlashInferAttentionBackend)):
        backend = cls(caches, DIMS)
        backend.plan(batch, static=True)
        out = outs[name] = torch.empty(tokens, DIMS.num_heads, DIMS.v_head_dim, device="cuda", dtype=torch.bfloat16)
        calls = [lambda c=c, b=backend, o=out: b.decode(q_nope, q_pe, w_kc, w_vc, caches[c % copies], o, batch)
                 for c in range(max(copies, 20))]
        row[f"{name}_us"] = round(graph_time_us(calls), 2)
    # Both graphs end on the same cache copy, so their outputs must agree (bf16 rounding apart).
    diff = (outs["triton"].float() - outs["flashinfer"].float()).norm() / outs["flashinfer"].float().norm()
    row["rel_diff"] = round(diff.item(), 5)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--q-len", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"{device}, V2-Lite attention, bf16, pages of {PAGE}; µs per layer (absorb + MLA + project)")
    print("| table | q_len | bs | context | tokens | Triton µs | flashinfer µs | Triton / flashinfer |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    cases = [(width, q_len, bs, context) for width, contexts in GRID for q_len in args.q_len for bs in args.bs
             for context in contexts if bs * context <= MAX_KEYS]
    rows = []
    for width, q_len, bs, context in cases:  # each row printed as it is measured
        r = measure(bs, q_len, context, width)
        torch.cuda.empty_cache()
        rows.append(r)
        print(f"| {width} | {q_len} | {bs} | {context} | {bs * q_len} | {r['triton_us']} | {r['flashinfer_us']} | "
              f"{r['triton_us'] / r['flashinfer_us']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
