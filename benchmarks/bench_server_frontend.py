"""The gRPC server's own cost, apart from the engine's: ``encore serve``'s server in front of an engine
that emits one token per request every ``--step-ms`` without running a model (``paced_engine.py``),
against its floor, a bare grpc.aio server whose handler streams the same messages at the same pace and
does nothing else. Both are driven by the same clients as ``bench_server.py`` (``--clients`` streams
from ``--client-processes`` processes, each trial started at once), and report TTFT, TPOT and
throughput as it does: medians over ``--trials``. For encore the engine's steps in the timed window
are counted too: a MIXED step is one whose arrivals join requests already decoding, so their number is
how many waves the burst of calls reached the engine in.

    python benchmarks/bench_server_frontend.py [--clients 64] [--max-tokens 64] [--step-ms 1.3]
        [--trials 3] [--client-processes 8] [--listeners 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Callable

import grpc

from bench_server import median_row, prompts, run_clients
from encore.models.tiny import default_model_dir
from encore.protos.encore.v1 import generate_pb2 as pb
from encore.server.config import ServerConfig
from encore.server.engine_spawn import spawn_engine
from encore.server.server import EncoreServer
from encore.server.servicer import SERVICE_NAME
from paced_engine import PacedEngine


class LoopThread:
    """An event loop in a daemon thread; ``call`` runs a coroutine there and returns its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def call(self, coroutine, timeout: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def bare_server(step_s: float, listeners: int) -> tuple[Callable, Callable]:
    """(start, stop) coroutine factories of ``listeners`` grpc.aio servers on one port (as encore's) whose
    Generate makes one token every ``step_s`` up to ``stopping.max_tokens`` and sends what is due each
    time it gets to run (as encore merges the tokens of steps it could not send yet), the last message
    with finish reason and usage."""
    servers = []

    async def generate(request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        n, sent = request.stopping.max_tokens, 0
        start = time.perf_counter()
        while sent < n:
            await asyncio.sleep(step_s)
            due = min(n, int((time.perf_counter() - start) / step_s))
            if due > sent:
                response = pb.GenerateResponse(request_id=request.request_id, token_ids=[5] * (due - sent),
                                               text="a" * (due - sent))
                sent = due
                if sent == n:
                    response.finish_reason = pb.FINISH_REASON_LENGTH
                    response.usage.completion_tokens = n
                yield response

    async def start() -> str:  # on the serving loop: a grpc.aio server belongs to the loop it is made on
        port = 0
        for _ in range(listeners):
            server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    generate, request_deserializer=pb.GenerateRequest.FromString,
                    response_serializer=pb.GenerateResponse.SerializeToString),
            }),))
            port = server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            servers.append(server)
        return f"127.0.0.1:{port}"

    async def stop() -> None:
        await asyncio.gather(*(server.stop(0) for server in servers))

    return start, stop


def encore_server(step_s: float, clients: int, listeners: int) -> tuple[Callable, Callable]:
    kwargs = {"model": str(default_model_dir()), "device": "cpu", "dtype": "float32", "max_num_seqs": clients,
              "num_kv_pages": 64, "max_model_len": 256, "step_s": step_s}
    server = EncoreServer(ServerConfig(port=0, listeners=listeners), kwargs, spawn_engine(kwargs, PacedEngine))

    async def start() -> str:
        await server.start()
        await server.start_engine()
        return server.address

    return start, server.stop


def measure(path: str, servers: tuple[Callable, Callable], args, encore: bool) -> dict:
    start, stop = servers
    loop = LoopThread()
    target = loop.call(start())
    try:
        texts = prompts(args.clients, 16)
        return median_row(path, run_clients(target, texts, args.max_tokens, args.trials, args.client_processes,
                                            encore=encore))
    finally:
        loop.call(stop())
        loop.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=1.3)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--client-processes", type=int, default=8)
    ap.add_argument("--listeners", type=int, default=ServerConfig().listeners,
                    help="grpc.aio servers on the port, for both sides (default: encore's, %(default)s)")
    ap.add_argument("--json")
    args = ap.parse_args()
    step_s = args.step_ms / 1e3
    rows = [measure("bare grpc.aio (floor)", bare_server(step_s, args.listeners), args, encore=False),
            measure("encore server, paced engine", encore_server(step_s, args.clients, args.listeners), args,
                    encore=True)]
    print(f"{args.clients} streams x {args.max_tokens} tokens, a token every {args.step_ms} ms, "
          f"{args.client_processes} client processes, {args.listeners} listener(s), median of {args.trials} trials")
    print(f"{'path':30} {'TTFT ms':>9} {'TPOT ms':>9} {'TPOT p99':>9} {'tok/s':>9} {'wall s':>8} {'tok/msg':>8}")
    for r in rows:
        print(f"{r['path']:30} {r['ttft_ms_mean']:>9.1f} {r['tpot_ms_mean']:>9.2f} {r['tpot_ms_p99']:>9.2f} "
              f"{r['throughput_tok_s']:>9.1f} {r['wall_s']:>8.3f} {r['tokens_per_message']:>8.2f}")
    for trial in rows[1]["trials"]:
        print(f"{rows[1]['path']:30} engine steps {trial['engine']['steps']}, "
              f"{trial['engine']['step_ms']:.3f} ms inside each (the pace asks {args.step_ms} ms)")
    ratio = rows[1]["throughput_tok_s"] / rows[0]["throughput_tok_s"]
    print(f"encore / floor: throughput x{ratio:.3f}, TTFT x{rows[1]['ttft_ms_mean'] / rows[0]['ttft_ms_mean']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"clients": args.clients, "max_tokens": args.max_tokens, "step_ms": args.step_ms,
                       "client_processes": args.client_processes, "listeners": args.listeners, "trials": args.trials, "rows": rows,
                       "throughput_ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
