"""The ``encore`` command.

``encore serve [--model DIR]``      the gRPC server (engine in its own process), see server.py
``encore generate [--model DIR] P`` one prompt through an in-process Engine, printed as it streams

Without --model both use the embedded encore-tiny checkpoint.

Environment variables are read here and nowhere else: ``ENCORE_API_KEY`` is the default of
--api-key, since a key given on the command line is visible to every user of the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from encore.engine.cli_options import add_engine_args, engine_kwargs
from encore.graphs.warmup import add_graphs_subcommands
from encore.models.shards import prefetch_in_background
from encore.server.config import ServerConfig
from encore.server.engine_spawn import spawn_engine


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="encore: %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encore", description="Serve MLA models (DeepSeek-V2/V3, Kimi K2).")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gRPC server",
                                description="Run the gRPC server (encore.v1.GenerationService, health, reflection).")
    defaults = ServerConfig()
    serve.add_argument("--host", default=defaults.host, help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=defaults.port, help="gRPC port, 0 picks one (default: %(default)s)")
    serve.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key serves TLS")
    serve.add_argument("--tls-key", help="PEM private key")
    serve.add_argument("--api-key", default=os.environ.get("ENCORE_API_KEY"),
                       help="require 'authorization: Bearer KEY' metadata (default: $ENCORE_API_KEY)")
    serve.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests,
                       help="requests admitted beyond max_num_seqs before RESOURCE_EXHAUSTED (default: %(default)s)")
    serve.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes,
                       help="largest gRPC message accepted or sent (default: %(default)s)")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    serve.add_argument("--listeners", type=int, default=defaults.listeners,
                       help="gRPC servers sharing the port, each taking in calls from its share of the client "
                            "connections (default: %(default)s)")
    serve.add_argument("--shutdown-grace", type=float, default=defaults.shutdown_grace_s,
                       help="seconds running streams may finish after SIGTERM/SIGINT (default: %(default)s)")
    add_engine_args(serve)
    serve.set_defaults(run=_serve)

    generate = commands.add_parser("generate", help="print the continuation of one prompt (in-process engine)")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--repetition-penalty", type=float, default=1.0)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    add_engine_args(generate)
    generate.set_defaults(run=_generate)

    add_graphs_subcommands(commands)
    return parser


def _serve(args: argparse.Namespace) -> int:
    try:
        config = ServerConfig(host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                              api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                              max_message_bytes=args.max_message_bytes, metrics_port=args.metrics_port,
                              shutdown_grace_s=args.shutdown_grace, listeners=args.listeners)
    except ValueError as exc:
        print(f"encore serve: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_run_server(config, engine_kwargs(args)))


async def _run_server(config: ServerConfig, kwargs: dict) -> int:
    began = time.monotonic()
    engine = spawn_engine(kwargs)  # before the server's imports, which its own then overlap (engine_spawn.py)
    from encore.server.engine_process import EngineStartError
    from encore.server.server import EncoreServer

    try:
        server = EncoreServer(config, kwargs, engine)
    except (OSError, ValueError) as exc:  # the model directory's tokenizer
        print(f"encore serve: {exc}", file=sys.stderr)
        engine.process.kill()
        return 1
    try:
        await server.start()
    except (RuntimeError, OSError) as exc:  # a port taken, a certificate unreadable
        print(f"encore serve: {exc}", file=sys.stderr)
        await server.stop()
        return 1
    print(f"encore: listening on {server.address} ({'TLS' if config.tls else 'plaintext'}); "
          f"health is NOT_SERVING until the engine has warmed up", flush=True)
    if server.metrics_port is not None:
        print(f"encore: metrics on http://{config.host}:{server.metrics_port}/metrics", flush=True)
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)

    def progress(message: str, at: float) -> None:
        """``at``: when it happened (time.monotonic()); an engine line may be read well after it was written."""
        print(f"encore: [{at - began:6.1f}s] {message}", flush=True)

    warm_up = asyncio.create_task(server.start_engine(progress))
    stop_wait = asyncio.create_task(stopping.wait())
    await asyncio.wait({warm_up, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if warm_up.done():
        try:
            info = warm_up.result()
        except EngineStartError as exc:
            print(f"encore serve: {exc}", file=sys.stderr)
            stop_wait.cancel()
            status = 1
        else:
            progress(f"ready: serving {info.model} ({info.architecture}, context {info.max_model_len}) "
                     f"on {server.address}", time.monotonic())
            await stop_wait
    else:
        warm_up.cancel()
    print("encore: shutting down", flush=True)
    await server.stop()
    return status


def _generate(args: argparse.Namespace) -> int:
    prefetch_in_background(args.model)  # the disk read overlaps the imports below
    from encore.engine import Engine, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        engine = Engine(**engine_kwargs(args))
        engine.add_request("cli", args.prompt, params)
    except ValueError as exc:
        print(f"encore generate: {exc}", file=sys.stderr)
        return 2
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
