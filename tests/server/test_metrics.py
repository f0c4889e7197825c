"""The Prometheus exposition: histogram arithmetic, the text format, and the live endpoint."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest

from encore.server.messages import Delta, EngineStats
from encore.server.metrics import Histogram, ServerMetrics
from encore.server.request_stream import RequestStream, SendPacer

SAMPLE = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? (-?[0-9.e+-]+|\+Inf|NaN)$')


def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-z_]+ .+$", line), line
            continue
        assert SAMPLE.match(line), line
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def test_histogram_buckets_are_cumulative_with_le_bounds():
    h = Histogram("x_seconds", "help", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    s = _samples("\n".join(h.render()))
    assert s['x_seconds_bucket{le="0.1"}'] == 2  # le: a value on the bound counts in it
    assert s['x_seconds_bucket{le="1.0"}'] == 3
    assert s['x_seconds_bucket{le="+Inf"}'] == s["x_seconds_count"] == 4
    assert s["x_seconds_sum"] == pytest.approx(3.65)


def test_a_stream_feeds_ttft_tpot_queue_time_and_counters():
    metrics = ServerMetrics()
    stream = RequestStream("r", [1, 2, 3], (), None, frozenset(), arrival=100.0, pacer=SendPacer(1))
    stream.feed(Delta("r", [5], None, None, queue_time=0.25))
    stream.take_response()
    stream.feed(Delta("r", [6, 7], None, "length"))
    stream.take_response()
    stream.first_token_at, stream.finished_at = 100.5, 101.5  # fix the clock
    metrics.observe_stream(stream)
    metrics.observe_stream(RequestStream("gone", [1], (), None, frozenset(), arrival=0.0, pacer=SendPacer(1)))
    metrics.observe_rejection("INVALID_ARGUMENT")
    stats = EngineStats(steps={"EXTEND": 2, "DECODE": 5, "MIXED": 1}, kv_pages_free=30, kv_pages_total=40,
                        running=1, waiting=2, preemptions=0, graph_replays=5, compiled_steps=1, eager_steps=2,
                        kernel_compiles=3, kv_pages_cached=12, prefix_cache_query_tokens=90, prefix_cache_hit_tokens=64,
                        overlapped_steps=6, step_seconds=1.5)
    s = _samples(metrics.render(stats, in_flight=3, engine_alive=True, listener_calls=[4, 0, 2]))
    assert s["encore_time_to_first_token_seconds_sum"] == pytest.approx(0.5)
    assert s["encore_time_per_output_token_seconds_sum"] == pytest.approx(0.5)  # 1 s over 2 later tokens
    assert s["encore_queue_time_seconds_sum"] == pytest.approx(0.25)
    assert s['encore_requests_finished_total{reason="length"}'] == 1
    assert s['encore_requests_finished_total{reason="cancelled"}'] == 1
    assert s['encore_requests_rejected_total{code="INVALID_ARGUMENT"}'] == 1
    assert (s["encore_prompt_tokens_total"], s["encore_generation_tokens_total"]) == (4, 3)
    assert s["encore_kv_cache_usage_ratio"] == pytest.approx(0.25)
    steps = ("encore_graph_replays_total", "encore_compiled_steps_total", "encore_eager_steps_total",
             "encore_overlapped_steps_total")
    assert [s[name] for name in steps] == [5, 1, 2, 6]
    assert s["encore_kernel_compiles_total"] == 3
    assert s["encore_engine_step_seconds_total"] == pytest.approx(1.5)
    assert s["encore_kv_cache_pages_cached"] == 12
    assert (s["encore_prefix_cache_query_tokens_total"], s["encore_prefix_cache_hit_tokens_total"]) == (90, 64)
    assert (s["encore_requests_running"], s["encore_requests_waiting"], s["encore_requests_in_flight"]) == (1, 2, 3)
    assert [s[f'encore_listener_calls_total{{listener="{i}"}}'] for i in range(3)] == [4, 0, 2]


def test_live_endpoint_serves_the_server_metrics(server, client):
    client.generate("def fibonacci(n):", max_tokens=4, temperature=0.0, ignore_eos=True)
    url = f"http://127.0.0.1:{server.server.metrics_port}"
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        s = _samples(reply.read().decode())
    assert s["encore_time_to_first_token_seconds_count"] >= 1
    assert s["encore_time_per_output_token_seconds_count"] >= 1
    assert s["encore_queue_time_seconds_count"] >= 1
    assert s["encore_engine_alive"] == 1 and s["encore_kv_cache_pages_total"] == 1023
    assert s['encore_engine_steps_total{mode="DECODE"}'] >= 3
    assert s["encore_overlapped_steps_total"] >= 4  # the shared server's engine overlaps its steps
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{url}/other", timeout=5)
    assert err.value.code == 404
