"""``encore generate`` in-process, and ``encore serve`` as a real process: TLS, API key, metrics, SIGTERM."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest
from server_harness import MAX_MODEL_LEN

from encore.engine import SamplingParams
from encore.models.tiny import default_model_dir
from encore.server.cli import main
from encore.server.client import Client


def test_generate_prints_the_engines_continuation(v3_dir, reference, capsys):
    status = main(["generate", "--model", str(v3_dir), "--device", "cpu", "--dtype", "float32",
                   "--max-tokens", "12", "--ignore-eos", "def fibonacci(n):"])
    want = reference.generate(["def fibonacci(n):"], SamplingParams(max_tokens=12, temperature=0.0,
                                                                  ignore_eos=True))[0]
    assert status == 0
    assert capsys.readouterr().out == want.text + "\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--model", "m", "--tls-cert", "only-a-cert.pem"], "TLS needs both tls_cert and tls_key"),
    (["serve", "--model", "m", "--port", "70000"], "port must be an integer in [0, 65535]"),
    (["serve", "--model", "m", "--shutdown-grace", "-1"], "shutdown_grace_s must be >= 0"),
    (["serve", "--model", "m", "--max-queued-requests", "-1"], "max_queued_requests must be an integer >= 0"),
    (["serve", "--model", "m", "--listeners", "0"], "listeners must be an integer in [1, 256], got 0"),
    (["generate", "--model", "m", "--temperature", "-1", "hi"], "temperature must be 0 (greedy) or in [1e-06, 1e+06]"),
])
def test_bad_options_exit_2_with_the_reason(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--graph-prefill-tokens", "128,5x2"], "--graph-prefill-tokens: expected comma-separated integers, "
                                                    "got '128,5x2'"),
    (["serve", "--graph-decode-sizes", "1,0"], "--graph-decode-sizes: every size must be >= 1, got '1,0'"),
])
def test_bad_graph_sizes_exit_2_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture
def tls_pair(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_serve_over_tls_with_api_key_and_metrics_then_stop_on_sigterm(v3_dir, tls_pair):
    cert, key = tls_pair
    env = os.environ | {"ENCORE_API_KEY": "cli-key"}
    command = [sys.executable, "-m", "encore.server.cli", "serve", "--model", str(v3_dir), "--port", "0",
               "--metrics-port", "0", "--tls-cert", str(cert), "--tls-key", str(key), "--device", "cpu",
               "--num-kv-pages", "64", "--max-model-len", str(MAX_MODEL_LEN), "--shutdown-grace", "2",
               "--listeners", "3"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()

    def wait_for(pattern: str) -> re.Match:
        seen = []
        while True:
            line = lines.get(timeout=90)
            seen.append(line)
            if match := re.search(pattern, line):
                return match
            assert process.poll() is None, "".join(seen)

    try:
        port = int(wait_for(r"listening on 127\.0\.0\.1:(\d+) \(TLS\)").group(1))
        metrics_url = wait_for(r"metrics on (http://\S+)").group(1)
        wait_for(r"\] loading ")
        wait_for(r"\] ready: serving ")
        with Client(f"localhost:{port}", api_key="cli-key", root_certificates=cert.read_bytes()) as client:
            assert client.health() == "SERVING"
            done = client.generate([5, 6, 7], max_tokens=3, ignore_eos=True)
            assert done.usage.completion_tokens == 3
        with urllib.request.urlopen(metrics_url, timeout=5) as reply:
            text = reply.read().decode()
        assert "encore_time_to_first_token_seconds_count 1" in text
        assert re.findall(r'encore_listener_calls_total\{listener="(\d+)"\}', text) == ["0", "1", "2"]
        process.send_signal(signal.SIGTERM)
        wait_for("shutting down")
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_engine_options_pass_through_and_unset_ones_keep_the_engine_defaults():
    from encore.server.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(
        ["serve", "--model", "m", "--device", "cpu", "--dtype", "bfloat16", "--attention-backend", "torch",
         "--max-num-batched-tokens", "512", "--chunked-prefill-size", "128", "--page-size", "8", "--num-kv-pages", "99",
         "--max-num-seqs", "7", "--max-model-len", "300", "--seed", "3", "--no-mixed-batch",
         "--no-prefix-caching", "--no-overlap-schedule", "--graph-decode-sizes", "1,4, 16", "--graph-prefill-tokens", ""])
    assert engine_kwargs(args) == {
        "model": "m", "device": "cpu", "dtype": "bfloat16", "attention_backend": "torch", "max_num_batched_tokens": 512,
        "chunked_prefill_size": 128, "page_size": 8, "num_kv_pages": 99, "max_num_seqs": 7, "max_model_len": 300,
        "seed": 3, "graph_decode_sizes": (1, 4, 16), "graph_prefill_tokens": (), "enable_mixed_batch": False,
        "enable_prefix_caching": False, "overlap_schedule": False}
    assert engine_kwargs(build_parser().parse_args(["generate", "--model", "m", "hi"])) == {"model": "m",
                                                                                          "device": "auto"}
    assert engine_kwargs(build_parser().parse_args(["serve"]))["model"] == str(default_model_dir())


@pytest.mark.parametrize("taken", ["--port", "--metrics-port"])
def test_serve_on_a_taken_port_exits_1_naming_it(v3_dir, taken):
    """The engine process is already running then (engine_spawn.py): it is stopped, and the error is one line."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        ports = {"--port": "0", "--metrics-port": "0"} | {taken: port}
        command = [sys.executable, "-m", "encore.server.cli", "serve", "--model", str(v3_dir), "--device", "cpu",
                   "--listeners", "1", *(arg for flag, value in ports.items() for arg in (flag, value))]
        child = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert child.returncode == 1, child.stderr[-3000:]
    assert "encore serve:" in child.stderr and port in child.stderr and "Traceback" not in child.stderr
