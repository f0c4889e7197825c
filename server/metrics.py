"""Prometheus metrics in the text exposition format (0.0.4), served over a minimal HTTP endpoint.

Written here rather than with prometheus_client to add no dependency: the server needs a few
histograms and counters, and gauges read from the engine's latest stats when scraped.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import Counter
from collections.abc import Callable

from encore.server.messages import EngineStats
from encore.server.request_stream import RequestStream

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help_text, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip((*map(_number, self.buckets), "+Inf"), self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {cumulative}"]
        return lines


class ServerMetrics:
    """Per-request latencies observed by the server, plus the engine's counters at scrape time."""

    def __init__(self) -> None:
        self.ttft = Histogram("encore_time_to_first_token_seconds",
                              "Time from receiving a request to its first generated token.", _LATENCY_BUCKETS)
        self.tpot = Histogram("encore_time_per_output_token_seconds",
                              "Mean time between a request's tokens after the first.", _TOKEN_BUCKETS)
        self.queue_time = Histogram("encore_queue_time_seconds",
                                    "Time from receiving a request to the first step that schedules it.",
                                    _LATENCY_BUCKETS)
        self.e2e = Histogram("encore_request_latency_seconds", "Time from receiving a request to its end.",
                             _LATENCY_BUCKETS)
        self.finished = Counter()  # by finish reason, "error" for failed streams, "cancelled" for gone clients
        self.rejected = Counter()  # by status code name
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def observe_stream(self, stream: RequestStream) -> None:
        """Records a request once its call is over, however it ended."""
        if stream.error is not None:
            self.finished["error"] += 1
        else:
            self.finished[stream.finish_reason or "cancelled"] += 1
        self.prompt_tokens += stream.num_prompt_tokens
        self.generation_tokens += stream.num_output_tokens
        if stream.queue_time is not None:
            self.queue_time.observe(stream.queue_time)
        if stream.first_token_at is not None:
            self.ttft.observe(stream.first_token_at - stream.arrival)
        if stream.finished_at is not None:
            self.e2e.observe(stream.finished_at - stream.arrival)
            if stream.first_token_at is not None and stream.num_output_tokens > 1:
                self.tpot.observe((stream.finished_at - stream.first_token_at) / (stream.num_output_tokens - 1))

    def observe_rejection(self, code_name: str) -> None:
        self.rejected[code_name] += 1

    def render(self, stats: EngineStats | None, in_flight: int, engine_alive: bool, listener_calls: list[int]) -> str:
        lines: list[str] = []
        for histogram in (self.ttft, self.tpot, self.queue_time, self.e2e):
            lines += histogram.render()
        lines += _family("encore_requests_finished_total", "counter", "Requests by how they ended.",
                         [({"reason": r}, n) for r, n in sorted(self.finished.items())])
        lines += _family("encore_requests_rejected_total", "counter", "Requests refused before running, by status.",
                         [({"code": c}, n) for c, n in sorted(self.rejected.items())])
        lines += _family("encore_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                         [({}, self.prompt_tokens)])
        lines += _family("encore_generation_tokens_total", "counter", "Tokens streamed to clients.",
                         [({}, self.generation_tokens)])
        lines += _family("encore_requests_in_flight", "gauge", "Requests accepted by the server and not finished.",
                         [({}, in_flight)])
        lines += _family("encore_listener_calls_total", "counter",
                         "Calls each gRPC listener took in (health and reflection aside).",
                         [({"listener": str(i)}, n) for i, n in enumerate(listener_calls)])
        lines += _family("encore_engine_alive", "gauge", "1 while the engine process runs.", [({}, int(engine_alive))])
        if stats is not None:
            lines += _engine_lines(stats)
        return "\n".join(lines) + "\n"


def _engine_lines(stats: EngineStats) -> list[str]:
    drafts = stats.spec_draft_tokens
    return [
        *_family("encore_requests_running", "gauge", "Requests in the engine's running batch.", [({}, stats.running)]),
        *_family("encore_requests_waiting", "gauge", "Requests waiting in the engine's queue.", [({}, stats.waiting)]),
        *_family("encore_kv_cache_usage_ratio", "gauge", "Share of KV pages in use.", [({}, stats.kv_usage)]),
        *_family("encore_kv_cache_pages_free", "gauge", "Free KV pages.", [({}, stats.kv_pages_free)]),
        *_family("encore_kv_cache_pages_total", "gauge", "Usable KV pages.", [({}, stats.kv_pages_total)]),
        *_family("encore_kv_cache_pages_cached", "gauge",
                 "KV pages of the prefix cache, in use or idle (idle ones count as free).",
                 [({}, stats.kv_pages_cached)]),
        *_family("encore_prefix_cache_query_tokens_total", "counter",
                 "Tokens of the requests the engine admitted, looked up in the prefix cache.",
                 [({}, stats.prefix_cache_query_tokens)]),
        *_family("encore_prefix_cache_hit_tokens_total", "counter",
                 "Admitted tokens whose KV pages came from the prefix cache.", [({}, stats.prefix_cache_hit_tokens)]),
        *_family("encore_engine_steps_total", "counter", "Engine steps by forward mode.",
                 [({"mode": m}, n) for m, n in sorted(stats.steps.items())]),
        *_family("encore_graph_replays_total", "counter", "Steps run by replaying a captured CUDA graph.",
                 [({}, stats.graph_replays)]),
        *_family("encore_compiled_steps_total", "counter",
                 "Steps run compiled without a CUDA graph: none captured, or no graph key held the step.",
                 [({}, stats.compiled_steps)]),
        *_family("encore_eager_steps_total", "counter", "Steps run eagerly.", [({}, stats.eager_steps)]),
        *_family("encore_engine_step_seconds_total", "counter",
                 "Wall time inside the engine's steps (scheduling, launches, the wait for the device); "
                 "over encore_engine_steps_total, its time per step.", [({}, stats.step_seconds)]),
        *_family("encore_overlapped_steps_total", "counter",
                 "Steps whose sampled ids stayed on the device and were read on a later call (overlap_schedule).",
                 [({}, stats.overlapped_steps)]),
        *_family("encore_kernel_compiles_total", "counter",
                 "GPU kernel variants compiled after start-up; each stalled the running requests.",
                 [({}, stats.kernel_compiles)]),
        *_family("encore_preemptions_total", "counter", "Requests preempted to free KV pages.",
                 [({}, stats.preemptions)]),
        *_family("encore_spec_draft_tokens_total", "counter", "Draft tokens proposed.", [({}, drafts)]),
        *_family("encore_spec_accepted_tokens_total", "counter", "Draft tokens accepted.",
                 [({}, stats.spec_accepted_tokens)]),
        *_family("encore_spec_acceptance_ratio", "gauge", "Accepted over proposed draft tokens.",
                 [({}, stats.spec_accepted_tokens / drafts if drafts else 0.0)]),
    ]


def _family(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {_number(value)}" if labels else f"{name} {_number(value)}")
    return lines


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


async def start_metrics_server(host: str, port: int, render: Callable[[], str]) -> asyncio.Server:
    """Serves ``GET /metrics`` (HTTP/1.1, one response per connection) on ``host:port``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=10)
            while (await asyncio.wait_for(reader.readline(), timeout=10)).strip():
                pass  # headers: nothing in them matters here
            method, path, *_ = request_line.decode("latin-1").split() + ["", ""]
            if method == "GET" and path.split("?")[0] == "/metrics":
                status, content_type, body = "200 OK", CONTENT_TYPE, render().encode()
            else:
                status, content_type, body = "404 Not Found", "text/plain", b"try GET /metrics\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError) as exc:
            log.debug("metrics connection dropped: %s", exc)
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
