"""EngineConfig: what the user asked for, validated once. Values found at start-up (page count,
EOS ids, the effective context length) live in the engine's runtime state, never written back."""

from __future__ import annotations

from dataclasses import dataclass

from encore.backends import BACKENDS
from encore.engine.spec.config import SpecConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
GRAPH_SIZES = ("graph_decode_sizes", "graph_q_lens", "graph_mixed_extends", "graph_mixed_decode_sizes",
               "graph_prefill_tokens", "graph_extend_sizes")  # the graph keys' buckets


def default_decode_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The DECODE keys' rows when ``graph_decode_sizes`` is None: powers of two up to 64, every 32 rows
    up to 256, every 64 past it, and ``max_num_seqs``, none above it."""
    sizes = {1, 2, 4, 8, 16, 32, 64, *range(96, 257, 32), *range(320, max_num_seqs + 1, 64), max_num_seqs}
    return tuple(sorted(s for s in sizes if s <= max_num_seqs))


def default_mixed_decode_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The MIXED keys' decode rows when ``graph_mixed_decode_sizes`` is None: 4, 16, 64, the powers of
    two from 128, and ``max_num_seqs``, none above it (graphs/keys.build_keys caps them at one row
    fewer, the most a step that also prefills can have)."""
    sizes = {4, 16, 64, max_num_seqs}
    sizes.update(1 << e for e in range(7, max_num_seqs.bit_length()))
    return tuple(sorted(s for s in sizes if s <= max_num_seqs))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """
    ``max_num_batched_tokens``: token budget of one step (decode rows claim it first).
    ``chunked_prefill_size``: the most prompt tokens one request may prefill in a step.
    ``page_size``: tokens per KV page. ``num_kv_pages``: pool size (None: sized from memory).
    ``kv_cache_memory_fraction``: on CUDA, the share of free GPU memory (after weights) given to
    the KV cache when ``num_kv_pages`` is None; on CPU the pool is sized to hold ``max_num_seqs``
    full-length sequences, capped by ``cpu_kv_cache_bytes``.
    ``enable_mixed_batch``: False runs prefill-only and decode-only steps (a baseline).
    ``enable_prefix_caching``: a request starts from the KV pages earlier requests computed for the
    same leading tokens (whole pages; engine/kv_cache.py), kept until their memory is needed.
    ``attention_backend``: "auto" (flashinfer where its MLA kernels take the model, its decode steps
    of at most 4 tokens on the Triton kernel; else triton on CUDA, torch on the CPU), "torch", "triton"
    or "flashinfer" (backends/selection.py).

    Compiled graphs (graphs/, DESIGN.md "Compiled graphs"):
    ``compile``: run steps through torch.compile with encore's passes, one graph per graph key;
    ``cuda_graphs``: capture each key's step in a CUDA graph and replay it. None (the default) means
    on for CUDA, off for the CPU (where ``compile=True`` still works, on Inductor's CPU backend).
    Every key is compiled (and captured) when the engine starts; a step that fits no key runs unpadded
    on its mode's compiled graph, or eager where its mode has no key (or ``compile`` is off).
    The keys, ``GraphKey(num_extends, q_len_per_req, bs, num_tokens)``:
    DECODE: ``graph_decode_sizes`` rows of each ``graph_q_lens`` tokens (1 + k is added for speculative
    verify). ``graph_q_lens`` None (the default): 1, or with speculative decoding 1 + k alone, since
    its every decode row verifies 1 + k tokens (q_len-1 keys would be 73 of its 158 default keys, 7 s
    of a warm start on the V2-Lite shape, H200). ``graph_decode_sizes`` None (the default):
    ``default_decode_sizes(max_num_seqs)``, powers of two up to 64, then every 32 rows up to 256 and
    every 64 past it, and ``max_num_seqs`` itself, so that every decode step replays. A step of more
    rows than the largest key launches its compiled graph's kernels one by one: at 96-256 rows of the
    V2-Lite shape (27 layers, H200) that took 24-35 ms a step, against 9.6-10.3 ms replayed, where
    padding costs little (96 rows on the 128-row key: 9.6 ms; benchmarks/README.md, "Overlapped
    steps", sessions 37 and 38).
    MIXED: up to ``graph_mixed_extends`` prefill rows (fewer are padded with one-token rows on the
    dummy page) whose tokens pad up to a ``graph_prefill_tokens`` bucket, plus
    ``graph_mixed_decode_sizes`` decode rows: a prompt (or a prompt's chunk) riding along running
    decodes (1), and a burst of arrivals joining them (16, 64). Decode rows, None (the default):
    ``default_mixed_decode_sizes(max_num_seqs)``, 4, 16, 64 and powers of two from 128 up to
    ``max_num_seqs``, itself included, so that a prompt joining any number of running decodes replays.
    EXTEND: up to ``graph_extend_sizes`` prefill rows, ``graph_prefill_tokens`` buckets.
    The 64-row prefill buckets (capped at what ``max_num_seqs`` allows) take a burst of calls that a
    server receives while a step runs: without them, 64 streams arriving at a V2-Lite-shape server
    (27 layers, H200) reached the engine in waves of 20-43 prompts, each of whose steps no key held
    (40-96 ms a step, the host launching the compiled graph's kernels one by one); on them every step
    replayed and the burst's throughput went from 0.89-0.91 to 0.94 of the in-process engine's
    (benchmarks/README.md, "gRPC server overhead on the GPU", "Session 36").
    The prefill buckets reach ``chunked_prefill_size``'s default (2048), so every chunk of a long
    prompt replays a graph: a prompt step that no key holds runs on its family's compiled graph, whose
    launches the host makes one by one, ~25 ms a step for DeepSeek-V2-Lite's 27 layers on an H100, as
    long as the GPU's work on 1k tokens. There a 1000-token prompt's first token took 58 ms
    compiled and 27.5 ms replayed (padded to 1024), a 1100-token one 50 and 43 ms (padded to 2048);
    the 16 keys of the 1024 and 2048 buckets took 0.7 s to capture and 220 MiB more graph pool
    (benchmarks/README.md, "Time to first token").
    An empty size tuple makes no keys of that kind.
    Decode and prefill rows are capped at what ``max_num_seqs`` allows a step of the key's mode (the
    largest bucket then holds every step, a MIXED key's padded prefill rows taking it past
    ``max_num_seqs`` rows: graphs/keys.build_keys); keys with more tokens than
    ``max_num_batched_tokens`` are dropped.
    ``overlap_schedule``: schedule and launch each step while the device still runs the one before
    (engine/engine.py, "Overlapped steps"); None (the default) means on for CUDA, off for the CPU,
    where there is no device work to overlap and a step's outputs would only come one call later;
    speculative decoding does not overlap (None then means off, True is refused).
    ``detokenize``: False leaves text and stop strings to the caller (the server process does them).
    ``speculative``: a SpecConfig (or its dict form: method, num_speculative_tokens, ...), None: off.
    ``graph_cache_dir``: where compile artifacts and the warm-up manifest persist
    (None: ``$XDG_CACHE_HOME/encore/graphs``, or ``~/.cache/encore/graphs``).
    """

    model: str
    device: str = "cuda"
    dtype: str = "auto"
    attention_backend: str = "auto"
    max_num_batched_tokens: int = 8192
    chunked_prefill_size: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    page_size: int = 16
    num_kv_pages: int | None = None
    kv_cache_memory_fraction: float = 0.85
    cpu_kv_cache_bytes: int = 2 << 30
    enable_mixed_batch: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    compile: bool | None = None
    cuda_graphs: bool | None = None
    graph_decode_sizes: tuple[int, ...] | None = None
    graph_q_lens: tuple[int, ...] | None = None
    graph_mixed_extends: tuple[int, ...] = (1, 16, 64)
    graph_mixed_decode_sizes: tuple[int, ...] | None = None
    graph_prefill_tokens: tuple[int, ...] = (128, 512, 1024, 2048)
    graph_extend_sizes: tuple[int, ...] = (1, 16, 64)
    graph_cache_dir: str | None = None
    overlap_schedule: bool | None = None
    speculative: SpecConfig | dict | None = None
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            object.__setattr__(self, "speculative", SpecConfig.from_dict(self.speculative))
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        for name in ("max_num_batched_tokens", "chunked_prefill_size", "max_num_seqs", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise ValueError(f"num_kv_pages must be >= 2 (page 0 is reserved), got {self.num_kv_pages!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        for name in ("enable_mixed_batch", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("compile", "cuda_graphs", "overlap_schedule"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None (device default), got {getattr(self, name)!r}")
        if self.overlap_schedule and self.speculative is not None:
            raise ValueError("overlap_schedule=True: speculative decoding does not overlap its steps; leave "
                             "overlap_schedule unset (None) or False with speculative")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got device {self.device!r}")
        if self.graph_q_lens is None:
            verify = self.speculative.num_speculative_tokens + 1 if self.speculative is not None else 1
            object.__setattr__(self, "graph_q_lens", (verify,))
        if self.graph_decode_sizes is None:
            object.__setattr__(self, "graph_decode_sizes", default_decode_sizes(self.max_num_seqs))
        if self.graph_mixed_decode_sizes is None:
            object.__setattr__(self, "graph_mixed_decode_sizes", default_mixed_decode_sizes(self.max_num_seqs))
        for name in GRAPH_SIZES:
            value = getattr(self, name)
            if (not isinstance(value, (tuple, list))
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
                raise ValueError(f"{name} must be a sequence of integers >= 1 (empty: no keys of that kind), "
                                 f"got {value!r}")
            object.__setattr__(self, name, tuple(sorted(set(value))))  # normalized once, never changed after
        if not self.graph_q_lens:
            raise ValueError("graph_q_lens must name at least one decode q_len (1 for plain decode), got ()")

    @property
    def use_compile(self) -> bool:
        return self.compile if self.compile is not None else self.device.startswith("cuda")

    @property
    def use_overlap_schedule(self) -> bool:
        return self.overlap_schedule if self.overlap_schedule is not None else self.device.startswith("cuda")

    @property
    def use_cuda_graphs(self) -> bool:
        return self.cuda_graphs if self.cuda_graphs is not None else self.device.startswith("cuda")
