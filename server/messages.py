"""What crosses the boundary between the server process and the engine process.

Commands go in (``Submit``, ``Abort``, ``Shutdown``); the engine process answers with start-up
``Progress``, then ``Ready``, then one ``StepResult`` per engine step, plus ``Rejected`` /
``StepFailed`` for requests the engine could not take or run, and ``Fatal`` before it exits on an
error. Only the new tokens of
a step travel (never a request's cumulative lists), so a message's size does not grow with the
output length. All are plain picklable dataclasses, but for a step's deltas: 64 of them as slotted
dataclasses took ~175 us to pickle and ~190 us to unpickle (a Python ``__getstate__``/``__setstate__``
call per object), as plain tuples ~17 and ~32 us; and building 64 ``Delta`` NamedTuples by keyword
took the engine process ~78 us a step against ~9 us for the same plain tuples. So a ``StepResult``
carries its deltas as plain tuples in ``Delta``'s field order, built so by the engine loop, and
the server reads them as ``Delta``s (``StepResult.deltas``). A ``request_id`` here is the engine's id of a
submission (see ``EngineProcess.submit``), not necessarily the client's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from encore.engine.request import TokenLogprob
from encore.engine.sampling_params import SamplingParams

# ---- server -> engine --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic() when the server received it (one clock for both processes)


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


# ---- engine -> server --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Progress:
    message: str
    # When the engine process wrote it (time.monotonic(), one clock for both processes): the server may
    # read it much later, since it starts reading only once it listens (engine_spawn.py).
    at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the server needs to know about the engine, found once it has loaded."""

    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    page_size: int
    engine_config: dict[str, str]
    speculative_method: str | None = None  # the engine's drafter; None: no speculative decoding
    # Captured CUDA graphs, as (num_extends, q_len_per_req, bs, num_tokens); empty without them.
    graph_keys: tuple[tuple[int, int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's counters after a step. Steps are graph replays (a captured CUDA graph),
    compiled steps (the compiled callable, no graph captured for the key) or eager steps."""

    steps: dict[str, int]  # by forward mode
    kv_pages_free: int
    kv_pages_total: int
    running: int
    waiting: int
    preemptions: int
    graph_replays: int
    compiled_steps: int
    eager_steps: int
    kernel_compiles: int = 0  # GPU kernel variants compiled after start-up
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    kv_pages_cached: int = 0  # pages of the prefix cache, in use or idle (idle ones count as free)
    prefix_cache_query_tokens: int = 0  # tokens of admitted requests
    prefix_cache_hit_tokens: int = 0  # of which the prefix cache held
    overlapped_steps: int = 0  # steps whose sampled ids stayed on the device and were read on a later call
    step_seconds: float = 0.0  # wall time inside Engine.step() calls

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_pages_free / self.kv_pages_total if self.kv_pages_total else 0.0


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Fatal:
    """The engine process cannot go on (it failed to start, or could not recover from a failed
    step) and is about to exit; ``message`` says why."""

    message: str


class Delta(NamedTuple):
    """One request's share of a step: its new tokens, and whether it finished."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    queue_time: float | None = None  # seconds from arrival to its first scheduled step, sent once
    num_accepted_tokens: int = 0  # draft tokens the target has accepted for it so far (cumulative)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True, slots=True)
class StepResult:
    rows: list[tuple]  # one per request: a Delta's fields, in order, as a plain tuple
    stats: EngineStats | None  # None: unchanged for the server's purposes (engine_worker.STATS_INTERVAL_S)

    @property
    def deltas(self) -> list[Delta]:
        return list(map(Delta._make, self.rows))


@dataclass(frozen=True, slots=True)
class Rejected:
    """The engine refused a request the server had accepted (``add_request`` raised ValueError)."""

    request_id: str
    message: str


@dataclass(frozen=True, slots=True)
class StepFailed:
    """A step raised: these requests were aborted in the engine and their streams must fail."""

    request_ids: list[str]
    message: str
