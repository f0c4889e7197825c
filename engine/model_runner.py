"""Owns the model, its latent KV cache and attention backend, and runs one forward + sample."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from encore.backends.base import AttentionBackend, MLADims
from encore.backends.context import StepContext
from encore.backends.kernel_variants import compiled_variants
from encore.backends.metadata import ForwardBatch, ForwardMode
from encore.backends.selection import select_backend
from encore.engine.config import EngineConfig
from encore.engine.grammar import apply_bitmask
from encore.engine.head_graphs import HeadGraphs
from encore.engine.kv_cache import allocate_kv_caches
from encore.engine.sampler import Sampler, SamplerOutput, SamplingTensors
from encore.engine.sampling_params import SamplingParams
from encore.engine.spec.draft_kv_cache import DraftKVCache
from encore.engine.step import scratch_batch
from encore.graphs.cache import GraphCache
from encore.graphs.compiler import CompiledModel
from encore.graphs.keys import keys_for
from encore.graphs.padding import StepBuffers, padded_index
from encore.graphs.runner import GraphRunner, KeyReport
from encore.graphs.weights import colocate_pre_attention_weights
from encore.models.config import ModelConfig
from encore.models.deepseek import DeepseekForCausalLM, fuse_shared_experts
from encore.models.eagle3 import Eagle3Config, Eagle3Model, load_eagle3
from encore.models.loader import has_mtp_weights, load_model

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _eagle3_config(draft_model: str, cfg: ModelConfig) -> Eagle3Config:
    draft = Eagle3Config.from_pretrained(draft_model)
    if (draft.target_hidden_size, draft.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(f"EAGLE-3 draft model {draft_model!r} is for a target of hidden size "
                         f"{draft.target_hidden_size} and vocab {draft.vocab_size}; this model has "
                         f"{cfg.hidden_size} and {cfg.vocab_size}")
    return draft


ModelBuilder = Callable[[ModelConfig, AttentionBackend, torch.device, torch.dtype], DeepseekForCausalLM]


_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments(device: torch.device) -> bool:
    """Turns on the caching allocator's expandable segments for a CUDA engine, unless the user's
    allocator configuration already says either way; True if it did. A CUDA model runner gives most of
    the memory left after the weights to its KV pool, and its steps' activations vary in size with the
    tokens a step holds: with fixed segments, freed blocks that a larger request cannot use pile up as
    fragmentation. DeepSeek-V2-Lite's shape on an H100 (bf16, random weights, `bench_overlap.py`) had
    5.65 GiB reserved but unallocated in split blocks after start-up, 1.05 GiB free, and its first
    8-prompt step ran out of memory allocating 512 MiB in the MoE; with expandable segments, 0 bytes in
    split blocks, 5.9 GiB free, and every batch size ran (benchmarks/README.md, "Memory"). Set
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False`` to keep fixed segments."""
    if device.type != "cuda" or any("expandable_segments" in os.environ.get(var, "") for var in _ALLOC_CONF_VARS):
        return False
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    log.info("CUDA caching allocator: expandable segments on")
    return True


def serial_host_ops(device: torch.device) -> None:
    """Once a CUDA model runner has its weights (loading and casting them does use torch's intra-op
    pool), torch runs host ops on one thread. Between launches the engine's host work is serial
    Python, while the pool is sized by the CPUs the process could use when torch started, not by a CPU
    quota (a container's CPU limit) or an affinity narrowed later: an op above the pool's grain (32 k
    elements, e.g. a structured-output bitmask at bs 64 over a 100 k vocabulary) wakes threads that
    then spin on the CPUs the engine needs. Held to one CPU after torch started its two-thread pool,
    the CI machine allocated that bitmask in 7.8 ms instead of 14 µs (benchmarks/README.md, "Host
    threads").

    Called before anything compiles, in every process that compiles (an engine's, ``encore graphs
    warmup``, the benchmarks): dynamo guards each compiled graph on torch's thread count, so a graph
    compiled under the pool rejected every call made on one thread, and each step that no key holds
    then ran eager; a graph cache written under the pool would be compiled again on loading. A CPU
    engine keeps the pool, which its model runs on."""
    if device.type == "cuda" and torch.get_num_threads() != 1:
        log.info("torch host ops: %d threads -> 1 (serial_host_ops)", torch.get_num_threads())
        torch.set_num_threads(1)


def triton_as_every_start(device: torch.device) -> None:
    """Fixes, before any kernel compiles, the two process-wide Triton settings that Inductor changes
    only in a process that itself builds or loads one of its kernels: a warm start (Inductor's kernels
    load in the engine's process before encore's first run), not a cold one (its compile workers build
    them and send them back pickled, torch's ``async_compile.triton``). Left to Inductor, a cold start
    cached encore's kernels under one setting and the next start looked them up under the other,
    missed every one and compiled them again. So every start keys and finds its kernels alike:

    - ptxas: torch's own (``TRITON_PTXAS_PATH``), as Inductor compiles with. Triton keys each kernel
      on the version of the ptxas its process ran first (benchmarks/README.md, "Session 28": ~8 s of a
      24 s warm start on an H200).
    - the cache directory: Triton's default (``TRITON_CACHE_DIR``), where Inductor would point it at
      the graph cache's, per identity (most likely why a V2-Lite-shape server's second start on an
      H200 spent 44 s before its warm-up step, against 0.7 s for an engine whose kernels were found;
      not yet measured with this setting; benchmarks/README.md, "Session 33"). Inductor's kernels
      share it, keyed by their source as Triton keys every kernel.

    A ptxas or a cache directory the user set is kept."""
    if device.type != "cuda":
        return
    import triton
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path

    _set_triton_ptxas_path()
    os.environ.setdefault("TRITON_CACHE_DIR", triton.knobs.cache.dir)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 build_model: ModelBuilder | None = None, on_progress: Callable[[str], None] | None = None) -> None:
        """``build_model`` replaces loading ``config.model`` (benchmarks build random weights with it);
        ``on_progress(line)`` once the weights are loaded."""
        self.device = torch.device(config.device)
        triton_as_every_start(self.device)  # before any Triton kernel compiles
        self.dtype = resolve_dtype(config.dtype, self.device)
        expandable_segments(self.device)  # before the weights and the KV pool take their memory
        cfg = model_config
        self.dims = MLADims(cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                            cfg.kv_lora_rank, cfg.softmax_scale)
        spec = config.speculative
        self.with_mtp = spec is not None and spec.method == "mtp"
        if self.with_mtp and not has_mtp_weights(config.model, cfg):
            raise ValueError(f"speculative method 'mtp' needs the checkpoint's nextn layer "
                             f"(model.layers.{cfg.num_hidden_layers}.*), which {config.model!r} does not have")
        num_layers = cfg.num_hidden_layers + (1 if self.with_mtp else 0)  # the MTP layer has its own cache
        draft = _eagle3_config(spec.draft_model, cfg) if spec is not None and spec.method == "eagle3" else None
        self.eagle3_config = draft
        if draft is not None and build_model is not None:
            raise ValueError("build_model cannot set up the target's auxiliary states for EAGLE-3; load config.model")
        aux_layers = draft.capture_layers(cfg.num_hidden_layers) if draft else ()
        # The drafter's KV shares the target's pages.
        token_elems = num_layers * cfg.latent_dim + (draft.kv_elems_per_token if draft else 0)
        self.num_pages = config.num_kv_pages or self._size_pool(config, cfg, token_elems, max_model_len)
        self.kv_caches = allocate_kv_caches(num_layers, self.num_pages, config.page_size, cfg.latent_dim,
                                            self.dtype, self.device)
        self.draft_kv_cache = DraftKVCache(self.num_pages, config.page_size, draft.num_key_value_heads, draft.head_dim,
                                           self.dtype, self.device) if draft else None
        self.backend = select_backend(config.attention_backend, self.device, self.dims, self.dtype)(
            self.kv_caches, self.dims)
        self.context = StepContext(self.backend)
        if build_model is None:
            start = time.perf_counter()
            self.model = load_model(Path(config.model), cfg, self.backend, self.device, self.dtype,
                                    with_mtp=self.with_mtp, aux_layers=aux_layers)
            loaded = (f"weights loaded: {sum(p.nbytes for p in self.model.parameters()) / 1e9:.1f} GB in "
                      f"{time.perf_counter() - start:.1f}s")
            log.info(loaded)
            if on_progress:
                on_progress(loaded)
        else:
            self.model = build_model(cfg, self.backend, self.device, self.dtype)
        if self.device.type == "cuda":  # the CPU keeps the plain formulation, the reference
            log.info("shared experts fused into the routed experts in %d MoE layers", fuse_shared_experts(self.model))
            torch.cuda.empty_cache()  # the replaced stacks: KV sizing above counted the weights once
        self.eagle3 = load_eagle3(spec.draft_model, draft, self.draft_kv_cache, self.model.model.embed_tokens,
                                  self.device, self.dtype) if draft else None
        serial_host_ops(self.device)  # before anything compiles (its docstring)
        self.sampler = Sampler()
        # Static page-table width of graph steps; a verify row may reserve k draft slots past the context.
        spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        row_tokens = min(max_model_len + spec_tokens, (self.num_pages - 1) * config.page_size)
        self.max_pages_per_row = -(-row_tokens // config.page_size)
        drafter = ({"method": spec.method, "config": asdict(draft) if draft else None}
                   if self.with_mtp or draft is not None else None)
        cache = (GraphCache.for_engine(config, cfg, drafter)
                 if config.use_compile or config.use_cuda_graphs else None)
        self.graphs = self._graph_runner(config, cache) if cache is not None else None
        self.graph_cache = cache if self.graphs is not None else None
        self.heads: HeadGraphs | None = None  # captured with the target's graphs (prepare_graphs)
        # Where a step's batch is sent to the device (engine.step.pack_batch); None: the current stream.
        self.upload_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.eager_steps = 0
        self.kernel_variants_at_start: int | None = None  # set by warm_up_kernels

    def _graph_runner(self, config: EngineConfig, cache: GraphCache) -> GraphRunner | None:
        keys = tuple(k for k in keys_for(config) if k.mode in self.backend.graph_modes)
        if not keys:
            log.warning("no graph key fits max_num_batched_tokens=%d / max_num_seqs=%d and backend %s's graph "
                        "modes: every step runs eager", config.max_num_batched_tokens, config.max_num_seqs,
                        self.backend.name)
            return None
        compiled = None
        if config.use_compile:
            from encore.passes.pipeline import passes_for

            colocate_pre_attention_weights(self.model)
            # One compile worker on the CPU: a worker pool's start-up outweighs what it parallelizes
            # for graphs this size, and it competes with the model's own threads.
            compiled = CompiledModel(self.model, passes_for, compile_threads=1 if self.device.type == "cpu" else None,
                                     artifacts=cache.precompiled_dir, pools=self.kv_pools)
        buffers = StepBuffers(max(k.num_tokens for k in keys), max(k.bs for k in keys), self.max_pages_per_row,
                              config.page_size, self.device, full_page_table=config.use_cuda_graphs)
        return GraphRunner(self.model, self.backend, self.context, keys, buffers, compiled, config.use_cuda_graphs)

    def prepare_graphs(self, on_key=None, rewrite_manifest: bool = False) -> list[KeyReport]:
        """Compiles (and captures) every graph key with compile artifacts in the graph cache, then
        (CUDA graphs) each DECODE key's head graphs (head_graphs.py). The manifest is written
        when the cache was empty (or stale, hence rebuilt), or when asked (warm-up); a sound one is
        left as the record of the warm-up that built it. No-op without graphs."""
        if self.graphs is None:
            return []
        found = self.graph_cache.read_manifest()  # a stale or corrupt cache is deleted here
        with self.graph_cache.active():
            reports = self.graphs.prepare(on_key)
        if self.graphs.cuda_graphs:
            self.heads = HeadGraphs(self.graphs, self.model.greedy_tokens, self.model.compute_logits,
                                    self.model.cfg.vocab_size, self.with_mtp or self.eagle3 is not None)
            self.heads.capture()
        if found is None or rewrite_manifest:
            self.graph_cache.write_manifest(reports)
        else:
            log.info("graph cache %s: %d keys ready in %.1fs", self.graph_cache.root, len(reports),
                     sum(r.compile_s + r.capture_s for r in reports))
        return reports

    @torch.inference_mode()
    def warm_up_kernels(self, config: EngineConfig) -> int:
        """Runs the eager forward once per kernel variant that an eager step can reach, so that serving
        compiles none (backends/kernel_variants.py); returns the steps run. CUDA only: no other device
        compiles kernels on first use.

        The variants: the fused MoE's one-token kernels and each row of its config table (by token
        count), the prefill kernel (one), and per decode q_len the split-KV decode with one split (many
        rows, short tables) and with several (one row, the widest table), the decode launch
        settings the backend picks by shape (``AttentionBackend.warm_up_decode``), and the small-M GEMV
        (``encore::dense``, the router, the absorbed per-head products) per row count (decode steps of
        each of its BLOCK_MS tokens) and per reduction length of the weights it runs, and the sampler's
        exponential race (one variant), top-k / top-p search (with and without top-k's phase) and greedy
        pick (per logits dtype: the model's, and float32 in the sampler). Each step runs on the dummy page
        (``scratch_batch``). What only compiled graphs launch (the norms passes/fuse_norms.py folds into
        the GEMVs, the router and the RoPE kernel; one token's RoPE with its latent query,
        passes/fuse_rope_absorb.py) compiled when ``prepare_graphs`` ran every key."""
        if self.device.type != "cuda":
            return 0
        from encore.backends import argmax_triton, gemv_triton, sampling_triton, truncation_triton
        from encore.backends.dense import GEMV_MAX_WEIGHT
        from encore.backends.moe_triton import config_token_counts

        page = config.page_size
        row_cap = self.max_pages_per_row * page
        spec = config.speculative
        q_lens = {1} | ({1 + spec.num_speculative_tokens} if spec is not None else set())
        steps = []  # (prefill row lengths, decode rows, q_len, table width)
        for tokens in config_token_counts(config.max_num_batched_tokens):
            rows = [min(row_cap, tokens - start) for start in range(0, tokens, row_cap)]
            if len(rows) <= config.max_num_seqs:
                steps.append((rows, 0, 1, -(-rows[0] // page)))
        for q in sorted(q_lens):
            if q <= config.max_num_batched_tokens:
                steps.append(([], 1, q, self.max_pages_per_row))
                steps.append(([], min(config.max_num_seqs, config.max_num_batched_tokens // q), q, -(-q // page)))
        for rows in gemv_triton.BLOCK_MS[1:]:
            if rows <= min(config.max_num_seqs, config.max_num_batched_tokens):
                steps.append(([], rows, 1, 1))
        for extend_lens, decodes, q_len, width in steps:
            self._forward_eager(scratch_batch(extend_lens, decodes, q_len, width, page, self.device))
        for q in sorted(q_lens):
            self.backend.warm_up_decode(q)
        modules = [self.model] + ([self.eagle3] if self.eagle3 is not None else [])
        gemv_triton.warm_up({p.shape[1] for m in modules for p in m.parameters()
                             if p.dim() == 2 and p.numel() <= GEMV_MAX_WEIGHT}, self.dtype, self.device)
        sampling_triton.warm_up(self.model.cfg.vocab_size, self.device)
        truncation_triton.warm_up(self.model.cfg.vocab_size, self.device)
        argmax_triton.warm_up(self.model.cfg.vocab_size, {self.dtype, torch.float32}, self.device)
        torch.cuda.synchronize(self.device)
        self.kernel_variants_at_start = compiled_variants()
        return len(steps)

    def _size_pool(self, config: EngineConfig, cfg: ModelConfig, token_elems: int, max_model_len: int) -> int:
        """``token_elems``: cache elements one token takes in every cache that pages index."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        page_bytes = config.page_size * token_elems * elem
        if self.device.type == "cuda":
            with torch.device("meta"):
                models = [DeepseekForCausalLM(cfg, None)]
                if self.eagle3_config is not None:  # its embedding counted even when shared: a small overestimate
                    models.append(Eagle3Model(self.eagle3_config, None))
                param_bytes = sum(p.numel() for m in models for p in m.parameters()) * elem
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int((free - param_bytes) * config.kv_cache_memory_fraction)
        else:
            wanted = config.max_num_seqs * -(-max_model_len // config.page_size) * page_bytes
            budget = min(wanted, config.cpu_kv_cache_bytes)
        pages = budget // page_bytes + 1
        if pages < 2:
            raise RuntimeError(f"no memory left for the KV cache on {self.device} (budget {budget} bytes)")
        log.info("KV cache: %d pages of %d tokens (%.1f MiB)", pages, config.page_size, pages * page_bytes / 2**20)
        return pages

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states of the step's tokens, or of ``token_ids`` only, [T, hidden];
        with EAGLE-3 on, each row continues with the target's auxiliary states ([T, 4 * hidden], see
        DeepseekForCausalLM). Through the step's graph key when one holds it, else its mode's compiled
        graph unpadded (graphs/runner.py), else eager. All tokens of a step with no padding among them
        (any DECODE step) are a view of the graph's output, which the next step rewrites."""
        if self.graphs is not None:
            ran = self.graphs.run(batch)
            if ran is not None:
                hidden, key = ran  # [key.num_tokens, hidden]
                if token_ids is None and key.num_extend_tokens == batch.num_extend_tokens:
                    return hidden[:batch.num_tokens]
                wanted = token_ids if token_ids is not None else torch.arange(batch.num_tokens, device=self.device)
                return hidden[padded_index(batch, key, wanted)]
        self.eager_steps += 1
        hidden = self._forward_eager(batch)
        return hidden if token_ids is None else hidden[token_ids]

    @property
    def kv_pools(self) -> list[torch.Tensor]:
        """Every paged KV cache, each [num_pages, ...]: the target's latent caches and EAGLE-3's."""
        return self.kv_caches + ([self.draft_kv_cache.cache] if self.draft_kv_cache is not None else [])

    @property
    def replayed(self) -> bool:
        """Whether the last ``forward`` replayed a captured CUDA graph (graphs/runner.py)."""
        return self.graphs is not None and self.graphs.last_replayed is not None

    def _forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """The model over ``batch`` as written, the backend planned on the host: hidden [T, hidden]."""
        batch.resolve_pending()
        with self.context.bind(batch):
            self.backend.plan(batch)
            return self.model(batch.input_ids, batch.positions, batch)

    def graph_stats(self) -> dict[str, int]:
        graphs = self.graphs
        compiled = graphs.compiled if graphs is not None else None
        return {
            "graph_replays": graphs.graph_replays if graphs is not None else 0,
            "compiled_steps": graphs.compiled_steps if graphs is not None else 0,
            "eager_steps": self.eager_steps,
            "attention_fallback_steps": self.backend.fallback_steps,
            "attention_slow_replans": self.backend.slow_replans,
            "attention_triton_decode_steps": self.backend.triton_decode_steps,
            "compiled_keys": compiled.compiled_keys if compiled is not None else 0,
            "compiled_graphs": compiled.compiled_graphs if compiled is not None else 0,
            "loaded_graphs": compiled.loaded_graphs if compiled is not None else 0,
            "recompiles": compiled.recompiles if compiled is not None else 0,
            "head_graph_replays": self.heads.replays if self.heads is not None else 0,
            "kernel_compiles": (compiled_variants() - self.kernel_variants_at_start
                                if self.kernel_variants_at_start is not None else 0),
        }

    @torch.inference_mode()
    def run_greedy(self, batch: ForwardBatch) -> torch.Tensor:
        """Token ids [N] of a step whose logits rows are all plain greedy (head_graphs.plain_greedy):
        through the key's head graph where the step replayed a DECODE graph, else the argmax of its
        logits."""
        decode = batch.mode is ForwardMode.DECODE  # every token is a logits row
        hidden = self.forward(batch, None if decode else batch.gather_ids)
        if self.replay_head(batch):
            return self.heads.tokens[:batch.num_tokens]
        return self.model.greedy_tokens(hidden)

    def replay_head(self, batch: ForwardBatch, rows: list[tuple[SamplingParams, int, int]] | None = None,
                    draft_probs: list[torch.Tensor | None] | None = None) -> bool:
        """Right after ``forward(batch)``: replays the greedy head graph of the DECODE key the step
        replayed, or with ``rows`` its stochastic verify head (``HeadGraphs.run_sampled``); False where
        there is none (no graphs, another mode, the step ran unreplayed, or a key with no such head)."""
        if batch.mode is not ForwardMode.DECODE or self.heads is None:
            return False
        key = self.graphs.last_replayed
        return self.heads.run(key) if rows is None else self.heads.run_sampled(key, rows, draft_probs)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, sampling: Callable[[], SamplingTensors],
            masks: Callable[[], torch.Tensor | None] | None = None) -> SamplerOutput:
        """Forward, then sample. ``masks`` builds the grammar bitmask on the host and ``sampling`` the
        sampling tensors, in that order; both are called after the forward is launched, so on CUDA
        they overlap the device's work."""
        logits = self.model.compute_logits(self.forward(batch, batch.gather_ids))  # [N, V]
        self.apply_masks(logits, masks)
        return self.sampler(logits, sampling())

    def apply_masks(self, logits: torch.Tensor, masks: Callable[[], torch.Tensor | None] | None) -> None:
        bitmask = masks() if masks is not None else None
        if bitmask is not None:
            apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True))
