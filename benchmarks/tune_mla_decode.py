"""Launch-setting sweep of the Triton MLA decode kernel, to retune ``decode_launch`` and
``choose_num_kv_splits`` (backends/triton_mla.py).

For each q_len × batch × context (every row at ``context`` cached tokens plus ``q_len`` new ones,
H × (R + Dr) latent, pages shuffled): every num_kv_splits × KernelConfig of the grid that could win
is run once and checked against the default's output (max |diff| / max |default| <= 2e-2, else
rejected), then timed by replaying a CUDA graph of back-to-back calls (median of the replays);
configurations that fail to compile or launch are skipped and counted. Beside them: the default
(``decode_launch``) and, where it runs, flashinfer's
``BatchMLAPagedAttentionWrapper`` planned as encore's flashinfer backend plans a decode. One input
per shape, so the KV stays in L2 where it fits (bs 1 and 8 at 1k): times there are below a model step's.

Pruned before compiling: block_m above q_len·H rounded up to 16 (idle lanes); tiles that spill
more than a few bytes (``tile_registers``); splits of fewer than max(16, block_n) keys (a split rounds
up to whole key tiles, so the rest would be empty); splits of a grid already over 8 programs per
SM. num_stages 3, 5 and 7: Triton (3.6 and 3.9) pipelines the kernel's KV loop only from 5 stages on
(the page-table load ahead of the KV load takes the first ones; 1-4 stages give one KV buffer and
the same schedule, 5-6 two, 7 three); a variant whose buffers overflow the shared memory fails to
launch and is counted as skipped. Every kernel variant is compiled first by a pool of processes into
Triton's on-disk cache.

    python benchmarks/tune_mla_decode.py [--q-len 1 2 4] [--batch 1 8 64] [--context 1024 8192]
        [--splits ...] [--block-m ...] [--block-n ...] [--num-warps ...] [--num-stages ...] [--json PATH]
    python benchmarks/tune_mla_decode.py --smoke   # CPU, Triton interpreter, tiny sizes: checks, no timing

Per shape the table gives the default's and the best candidate's µs and settings as (splits,
block_m, block_n, warps, stages), the next two, and flashinfer's µs; the JSON holds every candidate.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

START = time.perf_counter()
if "--smoke" in sys.argv:  # Triton picks the interpreter when it is first imported: set it before that
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from bench_decode_graphs import time_ms  # noqa: E402
from bench_mla_decode import HEADS, RANK, ROPE, SCALE  # noqa: E402
from encore.backends.base import MLADims  # noqa: E402
from encore.backends.flashinfer_backend import _WORKSPACE_BYTES, _MLAPlan, _rows, unsupported_reason  # noqa: E402
from encore.backends.triton_common import KernelConfig  # noqa: E402
from encore.backends.triton_mla import _num_sms, decode_launch, mla_decode  # noqa: E402

TOLERANCE = 2e-2
MIN_SPLIT_KEYS = 16
MAX_PROGRAMS_PER_SM = 8
# ``tile_registers`` counts the operands as registers, as the mma.sync dots of block_m 16-32 hold them;
# ptxas for sm_90 (R = 512, Dr = 64, bf16) fits those up to 136 in 255 registers, spills under 64 bytes
# at 172 and hundreds from 218 on. block_m 64 on eight warps (272) compiles to warpgroup MMAs that read
# the operands from shared memory, and fits (Triton 3.6: 255 registers, no spill); on four warps (544)
# it spills. 300 keeps the former.
MAX_TILE_REGISTERS = 300
GRAPH_US = 200  # calls per graph: enough of the default's to fill this, at most MAX_CALLS
MAX_CALLS = 16
# --smoke: sizes the interpreter runs in seconds; float16, as its bfloat16 tl.dot is wrong
# (tests/backends/test_triton_mla.py).
SMOKE = dict(heads=16, rank=32, rope=16, page_size=16, q_len=[1, 2], batch=[1, 3], context=[60], splits=[1, 2, 4],
             block_m=[16, 32], block_n=[16], num_warps=[4], num_stages=[1], dtype="float16")

Candidate = tuple[int, KernelConfig]  # (num_kv_splits, config)


class Shape:
    """Random inputs of one decode shape: ``batch`` rows of ``context`` cached tokens plus ``q_len`` new
    ones each, their pages shuffled over the cache."""

    def __init__(self, q_len: int, batch: int, context: int, heads: int, rank: int, rope: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.q_len, self.batch, self.context, self.heads, self.page_size = q_len, batch, context, heads, page_size
        self.seq_len = context + q_len
        self.width = triton.cdiv(self.seq_len, page_size)  # pages per row
        pages, tokens = batch * self.width, batch * q_len
        like = dict(device=device, dtype=dtype)
        self.q_lat = torch.randn(tokens, heads, rank, **like)  # [T, H, R]
        self.q_pe = torch.randn(tokens, heads, rope, **like)  # [T, H, Dr]
        self.kv_cache = torch.randn(pages, page_size, rank + rope, **like)  # [pages, page_size, R + Dr]
        self.page_table = torch.randperm(pages, device=device).view(batch, self.width).int()  # [B, width]
        self.seq_lens = torch.full((batch,), self.seq_len, dtype=torch.int32, device=device)  # [B]
        self.out = torch.empty_like(self.q_lat)  # [T, H, R]

    def name(self) -> str:
        return f"q={self.q_len} bs={self.batch} ctx={self.context}"

    def default(self, num_sms: int) -> Candidate:
        """What the Triton backend launches for this shape."""
        return decode_launch(self.batch, self.heads, self.q_len, self.width * self.page_size, num_sms,
                             self.q_lat.dtype)

    def decode(self, candidate: Candidate) -> torch.Tensor:
        splits, config = candidate
        return mla_decode(self.q_lat, self.q_pe, self.kv_cache, self.page_table, self.seq_lens, self.q_len, SCALE,
                          self.out, num_kv_splits=splits, config=config)


def tile_registers(config: KernelConfig, rank: int, rope: int, itemsize: int) -> float:
    """32-bit registers a thread needs for its share of the float32 accumulator [block_m, R], the query
    [block_m, R + Dr] and one KV tile [block_n, R + Dr]."""
    words = config.block_m * rank + (config.block_m + config.block_n) * (rank + rope) * itemsize / 4
    return words / (32 * config.num_warps)


def candidates(shape: Shape, rank: int, rope: int, itemsize: int, num_sms: int,
               args: argparse.Namespace) -> list[Candidate]:
    """The grid's (splits, config) pairs for ``shape``, less those that cannot win (module docstring)."""
    pairs = shape.q_len * shape.heads
    found = []
    for tile in itertools.product(args.block_m, args.block_n, args.num_warps, args.num_stages):
        config = KernelConfig(*tile)
        if (config.block_m > 16 * triton.cdiv(pairs, 16)
                or tile_registers(config, rank, rope, itemsize) > args.max_tile_registers):
            continue
        programs = shape.batch * triton.cdiv(pairs, config.block_m)
        for splits in args.splits:
            if (triton.cdiv(shape.seq_len, splits) >= max(MIN_SPLIT_KEYS, config.block_n)
                    and (splits == 1 or programs * splits <= MAX_PROGRAMS_PER_SM * num_sms)):
                found.append((splits, config))
    return found


def compile_runs(q_len: int, config: KernelConfig, runs: list[tuple[int, int]], sizes: tuple) -> None:
    """Launch ``config`` once per (context, splits) of ``runs`` on one-row inputs (the kernels' variants
    do not depend on the batch): Triton keeps what it compiles in its on-disk cache, where the sweep's
    own launches find it."""
    heads, rank, rope, page_size, dtype, device = sizes
    shapes = {c: Shape(q_len, 1, c, heads, rank, rope, page_size, getattr(torch, dtype), torch.device(device))
              for c in {c for c, _ in runs}}
    for context, splits in runs:
        try:
            shapes[context].decode((splits, config))
        except Exception:  # met again, and reported, by the sweep's own launch
            pass


def compile_all(work: list[tuple[Shape, list[Candidate]]], sizes: tuple, processes: int) -> None:
    """Compile every kernel variant the sweep launches, in parallel processes: Triton 3.9 holds the GIL
    through most of a compile (two threads compile this kernel 1.2x faster than one). One task per
    (q_len, config), so that splits sharing a variant compile it once."""
    runs: dict[tuple[int, KernelConfig], set[tuple[int, int]]] = {}
    for shape, todo in work:
        for splits, config in todo:
            runs.setdefault((shape.q_len, config), set()).add((shape.context, splits))
    spawn = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with ProcessPoolExecutor(min(processes, len(runs)), mp_context=spawn) as pool:
        tasks = [pool.submit(compile_runs, q_len, config, sorted(todo), sizes)
                 for (q_len, config), todo in runs.items()]
    failed = [task.exception() for task in tasks if task.exception()]
    if failed:  # the sweep compiles what these left out itself, one at a time
        print(f"{len(failed)} of {len(tasks)} compile tasks failed, first: {failed[0]!r}")


def graph_us(launch, calls: int, iters: int) -> float:
    """µs per call: median over ``iters`` replays of a CUDA graph of ``calls`` back-to-back launches."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            launch()
    return time_ms(graph.replay, iters) * 1e3 / calls


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|; NaN when ``got`` holds a NaN."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def flashinfer_launch(shape: Shape, dims: MLADims, workspace: torch.Tensor):
    """flashinfer's absorbed MLA on ``shape``'s inputs, planned as encore's flashinfer backend plans a decode."""
    plan = _MLAPlan(workspace, None, None)
    rows = _rows([shape.q_len] * shape.batch, [shape.seq_len] * shape.batch, shape.page_size)
    plan.plan(rows, shape.page_table, dims, shape.page_size, shape.q_len > 1, shape.q_lat.dtype, shape.kv_cache.dtype)
    return lambda: plan.wrapper.run(query=(shape.q_lat, shape.q_pe), kv_cache=shape.kv_cache)


def label(candidate: Candidate) -> str:
    splits, c = candidate
    return f"({splits}, {c.block_m}, {c.block_n}, {c.num_warps}, {c.num_stages})"


def sweep(shape: Shape, default: Candidate, todo: list[Candidate], iters: int, dims: MLADims,
          workspace: torch.Tensor | None) -> dict:
    """Check and (on CUDA) time the default, every candidate and flashinfer on one shape."""
    timed = shape.out.is_cuda
    want = shape.decode(default).clone()  # [T, H, R]
    row = {"q_len": shape.q_len, "batch": shape.batch, "context": shape.context, "seq_len": shape.seq_len,
           "default": label(default), "default_us": None, "best": None, "best_us": None, "top3": []}
    calls = 1
    if timed:
        calls = max(1, min(MAX_CALLS, round(GRAPH_US / graph_us(lambda: shape.decode(default), 1, iters))))
        row["default_us"] = round(graph_us(lambda: shape.decode(default), calls, iters), 2)
    results = []
    for candidate in todo:
        result = {"label": label(candidate), "splits": candidate[0], **dataclasses.asdict(candidate[1])}
        shape.out.fill_(float("nan"))  # a launch that writes nothing must not pass on an earlier output
        try:
            shape.decode(candidate)
        except Exception as exc:  # compile error, out of resources: cannot run here
            result["error"] = f"{type(exc).__name__}: {exc}"[:300]
        else:
            result["rel_err"] = round(max_rel_err(shape.out, want), 6)
            if not result["rel_err"] <= TOLERANCE:
                result["rejected"] = True
            elif timed:
                result["us"] = round(graph_us(lambda c=candidate: shape.decode(c), calls, iters), 2)
        results.append(result)
    ranked = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    if ranked:
        row["best_us"], row["best"] = ranked[0]["us"], ranked[0]["label"]
        row["top3"] = [f"{r['us']} {r['label']}" for r in ranked[:3]]
    if workspace is not None:
        try:
            launch = flashinfer_launch(shape, dims, workspace)
            row["flashinfer_rel_err"] = round(max_rel_err(launch(), want), 5)
            row["flashinfer_us"] = round(graph_us(launch, calls, iters), 2)
        except Exception as exc:  # an API this flashinfer lacks: report it, keep sweeping
            row["flashinfer_error"] = f"{type(exc).__name__}: {exc}"[:300]
    errors = [r["rel_err"] for r in results if "rel_err" in r and not r.get("rejected")]
    row.update(calls_per_graph=calls, tried=len(results), skipped=sum("error" in r for r in results),
               rejected=sum("rejected" in r for r in results), max_rel_err=max(errors, default=None),
               candidates=results)
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'q':>2} {'bs':>4} {'ctx':>6} {'default µs':>10} {'default':<19} {'best µs':>8} {'best':<19} "
          f"{'x':>5} {'flashinfer µs':>13} {'tried':>5} {'skip':>4} {'rej':>4}  next best")
    for r in rows:
        speedup = f"{r['default_us'] / r['best_us']:.2f}" if r["best_us"] else "-"
        print(f"{r['q_len']:>2} {r['batch']:>4} {r['context']:>6} {r['default_us'] or '-':>10} {r['default']:<19} "
              f"{r['best_us'] or '-':>8} {r['best'] or '-':<19} {speedup:>5} {r.get('flashinfer_us', '-'):>13} "
              f"{r['tried']:>5} {r['skipped']:>4} {r['rejected']:>4}  {'; '.join(r['top3'][1:])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q-len", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--rank", type=int, default=RANK)
    ap.add_argument("--rope", type=int, default=ROPE)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--block-m", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--num-stages", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--max-tile-registers", type=float, default=MAX_TILE_REGISTERS,
                    help="prune tiles above this many tile_registers (they spill); raise it to time them too")
    ap.add_argument("--iters", type=int, default=20, help="timed graph replays per candidate")
    ap.add_argument("--processes", type=int, default=os.cpu_count(), help="parallel Triton compiles")
    ap.add_argument("--budget-s", type=float, default=200, help="start no shape after this many seconds")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny sizes: no timing")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    torch.manual_seed(0)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    num_sms = _num_sms(device)
    # The latent kernels read only heads, R, Dr and the scale; nope / v dims are V2-Lite's (SCALE's 192).
    dims = MLADims(num_heads=args.heads, qk_nope_head_dim=128, qk_rope_head_dim=args.rope, v_head_dim=128,
                   kv_lora_rank=args.rank, softmax_scale=SCALE)
    reason = "--no-flashinfer" if args.no_flashinfer else unsupported_reason(dims, dtype, device)
    workspace = None if reason else torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"{where}, {num_sms} SMs, triton {triton.__version__}; H={args.heads} R={args.rank} Dr={args.rope} "
          f"{args.dtype} page {args.page_size}" + (f"; flashinfer not timed: {reason}" if reason else ""))

    shapes = [Shape(q, b, c, args.heads, args.rank, args.rope, args.page_size, dtype, device)
              for q, b, c in itertools.product(args.q_len, args.batch, args.context)]
    work = [(s, s.default(num_sms), candidates(s, args.rank, args.rope, dtype.itemsize, num_sms, args))
            for s in shapes]
    print(f"{len(shapes)} shapes, {sum(len(todo) for _, _, todo in work)} candidates; compiling on "
          f"{args.processes} processes", flush=True)
    sizes = (args.heads, args.rank, args.rope, args.page_size, args.dtype, device.type)
    compile_all([(s, [default] + todo) for s, default, todo in work], sizes, args.processes)
    print(f"compiled: {time.perf_counter() - START:.0f} s since start", flush=True)

    result = {"device": where, "torch": torch.__version__, "triton": triton.__version__, "args": vars(args),
              "rows": [], "not_run": []}
    for i, (shape, default, todo) in enumerate(work):
        if time.perf_counter() - START > args.budget_s:
            result["not_run"] = [s.name() for s, _, _ in work[i:]]
            print(f"budget of {args.budget_s:.0f} s spent; not run: {', '.join(result['not_run'])}")
            break
        row = sweep(shape, default, todo, args.iters, dims, workspace)
        result["rows"].append(row)
        print(f"[{i + 1}/{len(work)} {time.perf_counter() - START:.0f} s] {shape.name()}: default {row['default_us']} "
              f"µs {row['default']}, best {row['best_us']} µs {row['best']}, flashinfer "
              f"{row.get('flashinfer_us')} µs; {row['tried']} tried, {row['skipped']} skipped, {row['rejected']} "
              f"rejected, max rel err {row['max_rel_err']}", flush=True)
        if args.json:  # after every shape, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    print_table(result["rows"])
    for error in {r["flashinfer_error"] for r in result["rows"] if "flashinfer_error" in r}:
        print(f"flashinfer failed: {error}")


if __name__ == "__main__":
    main()
