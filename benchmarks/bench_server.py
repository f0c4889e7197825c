"""The gRPC server's overhead: N concurrent streaming clients against ``encore serve`` vs the same
requests stepped by an Engine in-process (the peer, measured in the same run).

Both sides run the same greedy requests (text prompts, ``ignore_eos``, ``max_tokens`` each) submitted
at once, and must produce the same tokens: in float32 (the default), since in 16-bit dtypes a row's
greedy tokens depend on the batch it runs in and the server takes a burst in waves. TTFT is from a request's own submission (its
``add_request``, or its client's call) to its first token, TPOT the mean gap between a request's later
tokens, throughput all output tokens over the wall time from the first submission to the last token. The
server runs as its own process (``python -m encore.server.cli serve``, which spawns the engine
process); the clients are asyncio streams in ``--client-processes`` processes (the streams dealt
out round-robin, each trial started in all of them at once through a barrier): one Python process
receiving 64 streams' messages is a bottleneck of its own, which real clients, one per user, do not
share. On a machine with few cores the processes compete for them, which is part of what this measures.

    python benchmarks/bench_server.py [--model DIR] [--clients 64] [--max-tokens 64] [--trials 5]
        [--client-processes 8] [--listeners 8] [--num-kv-pages 4096] [--pin] [--json out.json]

Each side runs the requests ``--trials`` times (one engine, one server), the trials taking turns (the
peer's first, then the server's first, ...) so that both sides see the machine in the same state, and
reports each metric's median over its trials: one run of a tiny model lasts well under a second, single
runs scatter, and on the GPU machines whole runs of one side moved by up to 1.6x between calls. One more
trial of each side runs first, untimed (the in-process peer's first full trial ran at 4-7x its later
TPOT on the H200s of session 21). It also reports the median of the paired throughput ratios (each
server trial over the peer trial just before it): on the H200s of session 22 both sides jumped between
a fast and a slow state from one trial to the next.

Without --model it serves the embedded encore-tiny checkpoint, whose steps are bound by the host; a model
whose steps are bound by the GPU, as in production: ``random_checkpoint.py`` (V2-Lite's widths).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from encore.models.tiny import default_model_dir
from encore.server.config import ServerConfig

WORDS = "def return class import while yield lambda async await value index count total result".split()


def prompts(n: int, words: int) -> list[str]:
    """``n`` texts of ``words`` words, drawn per request from a seeded generator: they differ from their
    first words on, so no request finds another's pages in the prefix cache (a stepped pattern gave only
    2 distinct texts for any n before session 21)."""
    return [" ".join(random.Random(i).choices(WORDS, k=words)) for i in range(n)]


def summarize(sends: list[float], firsts: list[float], ends: list[float], counts: list[int], wall: float,
              messages: list[int] | None = None) -> dict:
    """``messages``: the streamed responses per request (a server's), whose tokens per message show
    whether the server sent each token on its own (1.0) or merged the tokens of steps it fell behind on."""
    ttft = [f - s for s, f in zip(sends, firsts)]
    tpot = [(e - f) / (n - 1) for f, e, n in zip(firsts, ends, counts) if n > 1]
    summary = {"ttft_ms_mean": 1e3 * statistics.mean(ttft), "ttft_ms_p50": 1e3 * statistics.median(ttft),
               "tpot_ms_mean": 1e3 * statistics.mean(tpot), "tpot_ms_p50": 1e3 * statistics.median(tpot),
               "tpot_ms_p99": 1e3 * sorted(tpot)[int(0.99 * (len(tpot) - 1))],
               "throughput_tok_s": sum(counts) / wall, "wall_s": wall}
    if messages is not None:
        summary["tokens_per_message"] = sum(counts) / sum(messages)
    return summary


def peer_engine(engine_kwargs: dict, texts: list[str]):
    """The in-process peer: an Engine, warmed up, its start-up heap frozen as the server's engine's is."""
    from encore.engine import Engine, SamplingParams
    from encore.server.engine_worker import freeze_start_up_heap

    engine = Engine(**engine_kwargs)
    engine.generate(texts[:4], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    freeze_start_up_heap()
    return engine


def peer_trial(engine, tag: str, texts: list[str], max_tokens: int) -> tuple[dict, list]:
    """One timed run of all requests on the peer: (summary, tokens per request)."""
    from encore.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    n = len(texts)
    start = time.perf_counter()
    sends = [0.0] * n
    for i, text in enumerate(texts):
        sends[i] = time.perf_counter()
        engine.add_request(f"{tag}-{i}", text, params)
    firsts, ends, tokens = [0.0] * n, [0.0] * n, [[] for _ in range(n)]
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(out.request_id.rsplit("-", 1)[1])
            now = time.perf_counter()
            if out.new_token_ids and not tokens[i]:
                firsts[i] = now
            tokens[i].extend(out.new_token_ids)
            if out.finished:
                ends[i] = now
    wall = time.perf_counter() - start
    return ({**summarize(sends, firsts, ends, [len(t) for t in tokens], wall),
             "engine": step_counts(before, engine.stats())}, tokens)


def step_counts(before: dict, after: dict) -> dict:
    """How the timed run's engine steps ran: by mode, graph replays / compiled / eager, the kernels
    they compiled, and the engine's own wall time per step (inside ``Engine.step``): a server whose
    TPOT exceeds it lags behind its engine process, one whose TPOT matches it has a slower engine."""
    steps = {mode: n - before["steps"].get(mode, 0) for mode, n in after["steps"].items()}
    total = sum(steps.values())
    step_ms = 1e3 * (after["step_seconds"] - before["step_seconds"]) / total if total else 0.0
    return {"steps": steps, **{name: after[name] - before[name] for name in (
        "graph_replays", "compiled_steps", "eager_steps", "preemptions", "kernel_compiles")}, "step_ms": step_ms}


def run_clients(target: str, texts: list[str], max_tokens: int, trials: int, processes: int,
                encore: bool = True, before_each: Callable[[int], None] = lambda trial: None,
                cpus: set[int] | None = None) -> list[tuple[dict, list]]:
    """``trials`` runs of all requests as concurrent streams from ``processes`` client processes, each
    (summary, tokens per request); with the engine's step counts where the server is encore's.
    ``before_each(trial)`` runs before each trial starts, while the clients wait; ``cpus``: the CPUs
    the client processes may run on (None: any)."""
    from encore.server.client import Client

    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes + 1)
    shares = [list(range(p, len(texts), processes)) for p in range(processes)]
    pipes, workers = [], []
    for share in shares:
        ours, theirs = context.Pipe(duplex=False)
        worker = context.Process(target=client_process, args=(target, [texts[i] for i in share], max_tokens,
                                                              trials, barrier, theirs, cpus))
        worker.start()
        pipes.append(ours)
        workers.append(worker)
    runs = []
    with Client(target) as info_client:
        for trial in range(trials):
            before_each(trial)
            before = server_counts(info_client.server_info()) if encore else None
            barrier.wait()
            n = len(texts)
            sends, firsts, ends, tokens, messages = [0.0] * n, [0.0] * n, [0.0] * n, [[] for _ in range(n)], [0] * n
            for share, pipe in zip(shares, pipes):
                their = pipe.recv()
                for j, i in enumerate(share):
                    sends[i], firsts[i], ends[i], tokens[i], messages[i] = (column[j] for column in their)
            wall = max(ends) - min(sends)
            summary = summarize(sends, firsts, ends, [len(t) for t in tokens], wall, messages)
            if encore:
                summary["engine"] = step_counts(before, server_counts(info_client.server_info()))
            runs.append((summary, tokens))
    for worker in workers:
        worker.join(30)
    return runs


def client_process(target: str, texts: list[str], max_tokens: int, trials: int, barrier, results,
                   cpus: set[int] | None) -> None:
    """One client process: per trial, waits at ``barrier``, then streams all of ``texts`` at once and
    sends (call times, first-token times, end times, tokens) back on ``results``."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    asyncio.run(stream_trials(target, texts, max_tokens, trials, barrier, results))


async def stream_trials(target: str, texts: list[str], max_tokens: int, trials: int, barrier, results) -> None:
    from encore.server.client import AsyncClient

    async with AsyncClient(target, max_message_bytes=16 << 20) as client:
        await client.generate(texts[0], max_tokens=4, temperature=0.0)  # warm-up
        for _ in range(trials):
            await asyncio.to_thread(barrier.wait)
            n = len(texts)
            sends, firsts, ends, tokens, messages = [0.0] * n, [0.0] * n, [0.0] * n, [[] for _ in range(n)], [0] * n

            async def one(i: int) -> None:
                sends[i] = time.perf_counter()
                async for chunk in client.stream(texts[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                    if chunk.token_ids and not tokens[i]:
                        firsts[i] = time.perf_counter()
                    tokens[i].extend(chunk.token_ids)
                    messages[i] += 1
                ends[i] = time.perf_counter()

            await asyncio.gather(*(one(i) for i in range(n)))
            results.send((sends, firsts, ends, tokens, messages))


def check_same_tokens(peer: list[tuple[dict, list]], served: list[tuple[dict, list]], dtype: str,
                      allow_divergence: bool) -> list[str]:
    """Each trial's streams on the server carry as many tokens as the peer's (else raises: a lost or
    duplicated delta) and, unless ``allow_divergence``, the same tokens; otherwise raises naming, per
    trial, the streams that differ and the first token where each does. Returns those descriptions."""
    diverged = []
    for trial, ((_, want), (_, got)) in enumerate(zip(peer, served)):
        counts = {i: (len(w), len(g)) for i, (w, g) in enumerate(zip(want, got)) if len(w) != len(g)}
        if counts:
            raise AssertionError(f"trial {trial}: token counts differ (stream: peer, server) {counts}")
        firsts = {i: next(j for j, (a, b) in enumerate(zip(w, g)) if a != b)
                  for i, (w, g) in enumerate(zip(want, got)) if w != g}
        if firsts:
            diverged.append(f"trial {trial}: {len(firsts)} of {len(want)} streams, first differing token "
                            f"(stream: index) {firsts}")
    if diverged and not allow_divergence:
        why = ("" if dtype == "float32" else
               f"\nIn {dtype} a row's greedy tokens depend on the batch it runs in, and the server takes a burst "
               "in waves (an in-process engine given the 64 prompts at once or 8 a step differed in 26 of 64 "
               "streams on an H200, bfloat16; in float32 in none): compare in float32 (the default)")
        raise AssertionError("the server's tokens differ from the in-process engine's:\n" + "\n".join(diverged) + why)
    return diverged


def median_row(path: str, runs: list[tuple[dict, list]]) -> dict:
    """Each metric's median over the trials, and every trial's numbers."""
    summaries = [summary for summary, _ in runs]
    metrics = [k for k in summaries[0] if k != "engine"]
    return {"path": path, **{k: statistics.median(s[k] for s in summaries) for k in metrics}, "trials": summaries}


def server_counts(info) -> dict:
    return {"steps": dict(info.steps), "graph_replays": info.graph_replays, "compiled_steps": info.compiled_steps,
            "eager_steps": info.eager_steps, "preemptions": info.preemptions, "kernel_compiles": info.kernel_compiles,
            "step_seconds": info.engine_step_seconds}


def start_server(model: str, engine_args: list[str], log_path: str | None) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "encore.server.cli", "serve", "--model", model, "--port", "0", *engine_args]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target, lines = None, []
    for line in server.stdout:
        lines.append(line)
        if match := re.search(r"listening on (\S+)", line):
            target = match.group(1)
        if "ready: serving" in line:
            # Keep reading its output (to ``log_path``, or nowhere): a pipe nobody reads would stall the
            # server, and its engine process with it, once warnings filled it.
            threading.Thread(target=drain, args=(server.stdout, lines, log_path), daemon=True).start()
            return server, target
    raise RuntimeError(f"encore serve exited with {server.wait()}; its last output:\n{''.join(lines[-30:])}")


def cpu_sets(engine_cpus: int, server_cpus: int) -> tuple[set[int], set[int], set[int]]:
    """This process's CPUs dealt out: (the engines', the server process's, the clients')."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < engine_cpus + server_cpus + 1:
        raise SystemExit(f"--pin needs more than {engine_cpus + server_cpus} CPUs, this process has {len(cpus)}")
    return set(cpus[:engine_cpus]), set(cpus[engine_cpus:engine_cpus + server_cpus]), set(cpus[engine_cpus + server_cpus:])


def pin(pid: int, cpus: set[int], children: set[int] | None = None) -> None:
    """Every thread of process ``pid`` to ``cpus``, and every process below it to ``children`` (or ``cpus``)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                pin(int(child), cpus if children is None else children)


def drain(stream, head: list[str], log_path: str | None) -> None:
    """Reads ``stream`` to its end, writing ``head`` and then every line to ``log_path`` if given."""
    if log_path is None:
        for _ in stream:
            pass
        return
    with open(log_path, "w") as log:
        log.writelines(head)
        for line in stream:
            log.write(line)
            log.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5, help="timed runs per side; the tables show medians")
    ap.add_argument("--client-processes", type=int, default=8, help="processes the client streams are dealt to")
    ap.add_argument("--prompt-words", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json")
    ap.add_argument("--listeners", type=int, default=ServerConfig().listeners,
                    help="encore serve --listeners (default: %(default)s)")
    ap.add_argument("--pin", action="store_true",
                    help="run the peer and the server's engine process on the same 2 CPUs, the server process on "
                         "the next 2, the client processes on the rest (clients off the engine's CPUs, as when "
                         "they run on other machines)")
    ap.add_argument("--server-log", help="write the server's output (and its engine's warnings) here")
    ap.add_argument("--allow-divergence", action="store_true",
                    help="report streams whose tokens differ from the peer's instead of failing (token counts must "
                         "still match): a model with near-ties in its logits (random weights) can flip a greedy "
                         "token between batch compositions even in float32")
    ap.add_argument("--num-kv-pages", type=int, default=4096,
                    help="KV pages of each side's engine (default: %(default)s, 1024 tokens a stream at 64 streams): "
                         "the same pool on both, and room for the peer's weights beside the server's engine")
    args = ap.parse_args()
    model = args.model or str(default_model_dir())
    texts = prompts(args.clients, args.prompt_words)
    engine_kwargs = {"model": model, "device": args.device, "dtype": args.dtype, "max_num_seqs": args.clients,
                     "num_kv_pages": args.num_kv_pages}
    engine_cpus, server_cpus, client_cpus = cpu_sets(2, 2) if args.pin else (None, None, None)
    # The server first: its engine sizes its KV pool from the memory free when it starts, and the peer's
    # (started next) from what is left. Then each trial runs on the peer and right after on the server.
    server, target = start_server(model, ["--device", args.device, "--dtype", args.dtype,
                                          "--max-num-seqs", str(args.clients), "--num-kv-pages", str(args.num_kv_pages),
                                          "--listeners", str(args.listeners)],
                                 args.server_log)
    try:
        if args.pin:
            pin(os.getpid(), engine_cpus)  # this process (the peer's) and all below it, then the server apart
            pin(server.pid, server_cpus, children=engine_cpus)
        engine = peer_engine(engine_kwargs, texts)
        peer = []

        def peer_turn(trial: int) -> None:
            peer.append(peer_trial(engine, f"t{trial}", texts, args.max_tokens))

        served = run_clients(target, texts, args.max_tokens, 1 + args.trials, args.client_processes,
                             before_each=peer_turn, cpus=client_cpus)
    finally:
        server.terminate()
        server.wait(30)
    peer, served = peer[1:], served[1:]  # the warm-up trials
    diverged = check_same_tokens(peer, served, args.dtype, args.allow_divergence)
    for line in diverged:
        print("tokens diverged (--allow-divergence):", line)
    rows = [median_row("in-process Engine (peer)", peer), median_row("gRPC server", served)]
    ours, theirs = rows[1], rows[0]
    # Each server trial over the peer trial just before it: the machine's state drifts less within a pair.
    paired = statistics.median(s["throughput_tok_s"] / p["throughput_tok_s"]
                               for (p, _), (s, _) in zip(peer, served))
    overhead = {"tpot_ratio": ours["tpot_ms_mean"] / theirs["tpot_ms_mean"],
                "ttft_ratio": ours["ttft_ms_mean"] / theirs["ttft_ms_mean"],
                "throughput_ratio": ours["throughput_tok_s"] / theirs["throughput_tok_s"],
                "paired_throughput_ratio": paired}
    print(f"{Path(model).name}: {args.clients} concurrent streams x {args.max_tokens} tokens from "
          f"{args.client_processes} client process(es), {args.listeners} listener(s), {args.device}/{args.dtype}, "
          f"median of {args.trials} trials" + (f"; CPUs: engines {sorted(engine_cpus)}, server {sorted(server_cpus)}, "
                                               f"clients {sorted(client_cpus)}" if args.pin else ""))
    print(f"{'path':26} {'TTFT ms':>9} {'TPOT ms':>9} {'TPOT p99':>9} {'tok/s':>9} {'wall s':>8}")
    for r in rows:
        print(f"{r['path']:26} {r['ttft_ms_mean']:>9.1f} {r['tpot_ms_mean']:>9.2f} {r['tpot_ms_p99']:>9.2f} "
              f"{r['throughput_tok_s']:>9.1f} {r['wall_s']:>8.2f}")
    for r in rows:
        for trial in r["trials"]:
            print(f"{r['path']:26} engine steps {trial['engine']}")
    engine_ms = [statistics.median(t["engine"]["step_ms"] for t in r["trials"]) for r in rows]
    print(f"engine's own time a step (inside Engine.step), median of trials: in-process {engine_ms[0]:.3f} ms, "
          f"the server's engine process {engine_ms[1]:.3f} ms")
    print(f"server / in-process: TPOT x{overhead['tpot_ratio']:.3f}, TTFT x{overhead['ttft_ratio']:.3f}, "
          f"throughput x{overhead['throughput_ratio']:.3f} (median of paired trials x{paired:.3f}); the server sent "
          f"{ours['tokens_per_message']:.2f} tokens a message (1.00: each token on its own)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "clients": args.clients, "client_processes": args.client_processes,
                       "max_tokens": args.max_tokens, "listeners": args.listeners, "num_kv_pages": args.num_kv_pages,
                       "pinned": args.pin, "device": args.device, "dtype": args.dtype,
                       "trials": args.trials, "rows": rows, "overhead": overhead, "diverged": diverged}, f, indent=2)


if __name__ == "__main__":
    main()
