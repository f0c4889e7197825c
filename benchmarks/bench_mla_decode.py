"""MLA decode kernel time on the GPU, DeepSeek-V2-Lite attention shape (H=16, R=512, Dr=64, bf16).

For each batch size × context × q_len: encore's Triton ``mla_decode`` and, if flashinfer imports,
``flashinfer.mla.BatchMLAPagedAttentionWrapper`` on the same inputs (a peer), each timed by replaying
a CUDA graph of back-to-back calls. Floor: the bytes a call must move (every row's latent entries,
the queries, the output) over the device-copy bandwidth of a large ``copy_`` measured in the same run.
The calls of one graph cycle through separate copies of the cache, together several times the L2, so
every call reads its KV from HBM as a model step does (other layers' weights evict it in between).

    python benchmarks/bench_mla_decode.py [--page-size 64] [--json out.json]

``tune_mla_decode.py`` is the sweep that tunes ``decode_launch`` / ``choose_num_kv_splits``.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from encore.backends.triton_mla import mla_decode

HEADS, RANK, ROPE = 16, 512, 64
SCALE = 192 ** -0.5
COLD_BYTES = 256 << 20  # the caches one graph cycles through: about 5x an H100's 50 MB L2


def graph_time_us(calls, reps: int = 10) -> float:
    """Mean µs per call of ``calls`` (a list of zero-argument launches) replayed as one CUDA graph."""
    for call in calls:  # compile / plan-time work outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / (reps * len(calls))


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)] * 4)
    return 2 * src.numel() / (us * 1e-6)


class Case:
    """Inputs of one shape: ``copies`` caches with the same page table, queries packed [T, H, R + Dr]."""

    def __init__(self, bs: int, context: int, q_len: int, page_size: int) -> None:
        self.bs, self.context, self.q_len, self.page_size = bs, context, q_len, page_size
        pages_per_row = math.ceil(context / page_size)
        num_pages = bs * pages_per_row
        cache_bytes = num_pages * page_size * (RANK + ROPE) * 2
        self.copies = max(2, min(128, math.ceil(COLD_BYTES / cache_bytes)))
        self.caches = torch.randn(self.copies, num_pages, page_size, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
        self.page_table = torch.randperm(num_pages, device="cuda").view(bs, pages_per_row).int()
        self.seq_lens = torch.full((bs,), context, dtype=torch.int32, device="cuda")
        self.query = torch.randn(bs * q_len, HEADS, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(bs * q_len, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
        self.bytes = bs * context * (RANK + ROPE) * 2 + self.query.numel() * 2 + self.out.numel() * 2
        self.calls = max(self.copies, 20)

    def encore_calls(self):
        q_lat, q_pe = self.query[..., :RANK], self.query[..., RANK:]
        return [lambda c=c: mla_decode(q_lat, q_pe, self.caches[c % self.copies], self.page_table, self.seq_lens,
                                       self.q_len, SCALE, self.out)
                for c in range(self.calls)]

    def flashinfer_calls(self, out: torch.Tensor):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        self.workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        self.wrapper = BatchMLAPagedAttentionWrapper(self.workspace)
        arange = torch.arange(self.bs + 1, dtype=torch.int32, device="cuda")
        metadata = MLAPlanMetadata.csr(qo_indptr=arange * self.q_len, kv_indptr=arange * self.page_table.shape[1],
                                       kv_indices=self.page_table.flatten(), kv_len_arr=self.seq_lens)
        self.wrapper.plan(metadata=metadata, num_heads=HEADS, head_dim_ckv=RANK, head_dim_kpe=ROPE,
                          page_size=self.page_size, causal=True, sm_scale=SCALE, q_data_type=torch.bfloat16,
                          kv_data_type=torch.bfloat16)
        return [lambda c=c: self.wrapper.run(query=self.query, kv_cache=self.caches[c % self.copies], out=out)
                for c in range(self.calls)]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure(case: Case, bandwidth: float) -> dict:
    floor_us = case.bytes / bandwidth * 1e6
    row = {"bs": case.bs, "context": case.context, "q_len": case.q_len, "page_size": case.page_size,
           "bytes": case.bytes, "floor_us": round(floor_us, 2),
           "encore_us": round(graph_time_us(case.encore_calls()), 2)}
    mine = case.out.clone()
    try:
        theirs = torch.empty_like(case.out)
        row["flashinfer_us"] = round(graph_time_us(case.flashinfer_calls(theirs)), 2)
        # Both graphs end with the same call (same cache copy), so the two outputs must agree.
        row["rel_diff_vs_flashinfer"] = round(rel_diff(mine, theirs), 5)
    except Exception as exc:  # no flashinfer, or an API it does not have: report, keep benchmarking
        row["flashinfer_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--q-len", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s, page size {args.page_size}")
    rows = []
    for q_len in args.q_len:
        for bs in args.bs:
            for context in args.context:
                rows.append(measure(Case(bs, context, q_len, args.page_size), bandwidth))
                torch.cuda.empty_cache()
    header = (f"{'q':>2} {'bs':>4} {'ctx':>6} {'floor µs':>9} {'encore µs':>10} {'x floor':>8} "
              f"{'flashinfer µs':>14} {'x floor':>8}")
    print(header)
    for r in rows:
        peer = r.get("flashinfer_us")
        peer_cols = f"{peer:>14} {peer / r['floor_us']:>8.2f}" if peer else f"{'-':>14} {'-':>8}"
        print(f"{r['q_len']:>2} {r['bs']:>4} {r['context']:>6} {r['floor_us']:>9} {r['encore_us']:>10} "
              f"{r['encore_us'] / r['floor_us']:>8.2f} {peer_cols}")
    errors = {r["flashinfer_error"] for r in rows if "flashinfer_error" in r}
    for error in errors:
        print(f"flashinfer not timed: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
