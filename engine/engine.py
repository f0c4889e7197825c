"""The public engine API: add requests, step, stream outputs; ``generate`` for batch use.

Overlapped steps (``EngineConfig.overlap_schedule``, on for CUDA). A step's host work — scheduling,
building the step, padding it into the graph buffers, planning attention, reading the sampled ids
back and committing them — otherwise runs while the device idles: on an H200 host, encore-tiny
decoded at 0.33 ms a token at bs 1 this way and at 0.23 ms overlapped (benchmarks/README.md,
"Overlapped steps"). So ``step`` launches step i + 1 before it reads step i's tokens: step i's
sampled ids stay on the device, their rows hold ``request.PENDING`` in ``token_ids``, and step
i + 1's decode rows take their input ids from step i's output on the device (``ForwardBatch.pending``),
in stream order. Each call thus returns the outputs of the step before the one it launched. Where a
step's sampling reads host state that the previous token changes — a grammar's matcher, penalties'
token counts — the step in flight is read and committed as soon as the step's forward is launched,
and the mask and counts are built while the device runs it (a row short of its ``min_tokens``, whose
stop tokens are masked, goes the same way). A step that completed prompts without
a graph replay (a burst of long prompts, whose steps take long to launch on the host) is read and
returned before the next step is scheduled, so its first tokens do not wait for the next launch.
What a step launched on a guess costs: a row that ends at its pending token (EOS, a stop string) runs
one more step whose output is dropped; a row that ends by length is known to end and gets no next
step. Tokens are the same as without overlap (CPU and GPU tests). Speculative steps are not launched
on a guess (the next step's rows depend on each row's accepted count), but they overlap in part: the
host reads a step's verdict before its drafts are made, and commits it and builds the next step while
the device drafts (engine/spec/speculator.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import numbers
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from encore.backends.host_tensors import Readback
from encore.engine.config import EngineConfig
from encore.graphs.runner import KeyReport
from encore.engine.detokenizer import IncrementalDetokenizer
from encore.engine.grammar import Ban, GrammarCompilerPool, GrammarDeadEnd, RequestGrammar, step_bitmask
from encore.engine.head_graphs import plain_greedy
from encore.engine.kv_cache import KVCacheManager
from encore.engine.model_runner import ModelBuilder, ModelRunner
from encore.engine.request import PENDING, Request, RequestOutput, RequestStatus, TokenLogprob
from encore.engine.sampler import SamplerOutput, SamplingTensors
from encore.engine.sampling_params import SamplingParams
from encore.engine.scheduler import ScheduledStep, Scheduler
from encore.engine.spec.speculator import RowResult, Speculator
from encore.engine.step import build_forward_batch, sampling_tensors
from encore.engine.tokenizer import load_tokenizer, prompt_encoder
from encore.models.config import ModelConfig

log = logging.getLogger(__name__)


class Engine:
    """An MLA model served step by step.

    >>> engine = Engine(model="path/to/hf_dir", device="cpu")
    >>> outs = engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))

    ``model=None`` serves the embedded encore-tiny checkpoint.
    """

    def __init__(self, model: str | None = None, device: str = "auto",
                 on_graph_key: Callable[[int, int, KeyReport], None] | None = None,
                 on_progress: Callable[[str], None] | None = None,
                 build_model: ModelBuilder | None = None, **options) -> None:
        """``on_graph_key(done, total, report)`` is called as each graph key is compiled/captured at
        start-up, ``on_progress(line)`` once the weights are loaded and as the kernel warm-up starts and
        ends (progress for ``encore serve``); ``build_model`` replaces loading the weights of
        ``model`` (whose config.json still shapes it: benchmarks build random weights on the GPU);
        ``options`` are EngineConfig's fields."""
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if model is None:
            from encore.models.tiny import default_model_dir

            model = default_model_dir()
        self.config = EngineConfig(model=str(model), device=device, **options)
        model_dir = Path(self.config.model)
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self._encode = prompt_encoder(self.tokenizer)
        wanted_len = self.config.max_model_len or self.model_config.max_position_embeddings
        self.runner = ModelRunner(self.config, self.model_config, wanted_len, build_model, on_progress)
        total = len(self.runner.graphs.keys) if self.runner.graphs is not None else 0
        progress = (lambda index, report: on_graph_key(index + 1, total, report)) if on_graph_key else None
        self.runner.prepare_graphs(on_key=progress)  # compile (and capture) every graph key before the first step
        start = time.perf_counter()
        if on_progress and self.runner.device.type == "cuda":
            on_progress("warming up the kernels an eager step can launch")
        warm_steps = self.runner.warm_up_kernels(self.config)  # and every kernel an eager step can launch
        if warm_steps:
            done = f"kernel warm-up: {warm_steps} eager steps in {time.perf_counter() - start:.1f}s"
            log.info(done)
            if on_progress:
                on_progress(done)
        spec = self.config.speculative
        self.speculator = Speculator(spec, self.runner, self.model_config.vocab_size) if spec else None
        # A model drafter's KV at a page's last slot depends on the token after the page (kv_cache).
        model_drafter = self.speculator is not None and self.speculator.model_drafter is not None
        self.kv = KVCacheManager(self.runner.num_pages, self.config.page_size, self.config.enable_prefix_caching,
                                 key_next_token=model_drafter)
        capacity = self.kv.num_total_pages * self.config.page_size
        if wanted_len > capacity:
            log.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it", wanted_len, capacity)
        self.max_model_len = min(wanted_len, capacity)
        self.scheduler = Scheduler(self.kv, self.config.max_num_batched_tokens, self.config.chunked_prefill_size,
                                   self.config.max_num_seqs, self.config.enable_mixed_batch)
        self.eos_token_ids = self._eos_ids(model_dir)
        self.requests: dict[str, Request] = {}
        self._grammars: GrammarCompilerPool | None = None
        self._aborted: list[Request] = []
        self._rng = random.Random(self.config.seed)
        self._ids = itertools.count()
        self._steps = {"EXTEND": 0, "DECODE": 0, "MIXED": 0}
        self._preemptions = 0
        self._overlap = self.config.use_overlap_schedule and self.speculator is None  # (True with it: refused)
        self._in_flight: _InFlight | None = None
        self._overlapped = 0  # steps whose sampled ids stayed on the device and were read on a later call
        self._step_seconds = 0.0  # wall time inside step() calls

    def _eos_ids(self, model_dir: Path) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        params.check_vocab(self.model_config.vocab_size)
        if params.bans_stop_tokens and len(self._stop_tokens(params)) == self.model_config.vocab_size:
            raise ValueError(f"min_tokens={params.min_tokens} would ban every token: stop_token_ids"
                             f"{'' if params.ignore_eos else ' and EOS'} cover the whole vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        if params.speculative and self.speculator is None:
            raise ValueError("speculative=True, but this engine runs without speculative decoding "
                             "(start it with speculative={'method': ..., 'num_speculative_tokens': k})")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        detok = IncrementalDetokenizer(self.tokenizer if self.config.detokenize else None, prompt_ids, params.stop)
        spec = params.grammar
        grammar = RequestGrammar(self._grammar_pool().submit(spec)) if spec is not None else None
        req = Request(request_id, prompt_ids, params, seed, detok, grammar=grammar)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _grammar_pool(self) -> GrammarCompilerPool:
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output (json_schema/regex/ebnf/json_object) needs the model's "
                                 "tokenizer, and the model directory has none")
            self._grammars = GrammarCompilerPool(self.tokenizer, self.model_config.vocab_size,
                                                 sorted(self.eos_token_ids))
        return self._grammars

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model directory has no tokenizer; pass token ids")
            ids = self._encode(prompt)
        else:
            ids = list(prompt)
            if any(type(t) is not int for t in ids):  # the ABC check below is ~10x slower a token
                wrong = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
                if wrong:
                    raise ValueError(f"prompt token ids must be integers, got {wrong[:8]}")
                ids = [int(t) for t in ids]  # numpy's integers
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty; it must have at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is {self.max_model_len} tokens "
                             f"(max_model_len), which leaves no room to generate")
        return ids

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self.scheduler.remove(req)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        req.drop_pending()  # it keeps only the tokens it was given
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"
        self._aborted.append(req)

    @property
    def overlap_schedule(self) -> bool:
        """Whether steps overlap (module docstring); may be switched while nothing is in flight
        (benchmarks compare both on one engine)."""
        return self._overlap

    @overlap_schedule.setter
    def overlap_schedule(self, on: bool) -> None:
        if self._in_flight is not None:
            raise RuntimeError("overlap_schedule can only change while no step is in flight")
        if on and self.speculator is not None:
            raise ValueError("speculative decoding does not overlap its steps")
        self._overlap = on

    def has_unfinished_requests(self) -> bool:
        return bool(self._aborted) or self.scheduler.has_work() or self._in_flight is not None

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step and returns the outputs it completed: with overlapped steps, those of the
        step launched by the call before, and where those are first tokens of a step that ran without
        a graph, it launches nothing (module docstring). Its wall time adds to ``stats()["step_seconds"]``."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self._step_seconds += time.perf_counter() - start

    def _step(self) -> list[RequestOutput]:
        outputs = [self._output(r, []) for r in self._aborted]
        for req in self._aborted:
            del self.requests[req.request_id]
        self._aborted.clear()
        in_flight = self._in_flight
        if in_flight is not None and in_flight.first_tokens and not in_flight.replayed:
            outputs.extend(self._complete_in_flight())  # first tokens out before a slow launch (module docstring)
            return outputs
        spec = self.speculator
        step = self.scheduler.schedule(spec.q_len if spec else 1, spec.lookahead if spec else 0)
        self._preemptions += len(step.preempted)
        if step.empty:
            outputs.extend(self._complete_in_flight())
            return outputs
        outputs.extend(self._speculative_step(step) if spec is not None else self._plain_step(step))
        self.scheduler.cache_pages(step)
        return outputs

    def _speculative_step(self, step: ScheduledStep) -> list[RequestOutput]:
        spec = self.speculator
        drafts = spec.prepare(step)
        batch, sampled = build_forward_batch(step, self.kv, self.runner.device, stream=self.runner.upload_stream,
                                             drafts=drafts)
        self._steps[batch.mode.value] += 1

        def masks():  # built on the host while the device runs the forward
            spec.host_drafts()  # where a grammar reads its row's drafts (spec.prepare)
            groups = [(r.grammar, [], self._ban(r)) for r in sampled[:len(sampled) - len(step.decodes) * spec.q_len]]
            # A verify row's mask rows: one, then one a draft; only a grammar reads the drafts themselves.
            groups += [(r.grammar, r.draft_token_ids if r.grammar is not None else [0] * spec.k, self._ban(r))
                       for r in step.decodes]
            return step_bitmask(groups, self.model_config.vocab_size)

        results = spec.run(step, batch, sampled, masks)
        for req, n in step.extends:
            req.num_computed += n
        for res in results[len(results) - len(step.decodes):]:
            res.request.num_computed += 1 + (res.num_accepted or 0)
        return self._commit(results)

    def _plain_step(self, step: ScheduledStep) -> list[RequestOutput]:
        """Launches the step; with overlap, holds its ids on the device and commits the step in flight
        (module docstring), else reads them back and commits them. A grammar's mask and penalties'
        token counts need the rows' previous tokens: they are built, after the step in flight is
        committed, while the device runs this step's forward."""
        in_flight, self._in_flight = self._in_flight, None
        device = self.runner.device
        batch, sampled = build_forward_batch(step, self.kv, device,
                                             in_flight.token_ids if in_flight is not None else None,
                                             self.runner.upload_stream)
        self._steps[batch.mode.value] += 1
        settled: list[RequestOutput] = []

        def settle() -> None:  # the step in flight, read and committed (once)
            nonlocal in_flight
            if in_flight is not None:
                settled.extend(self._commit_in_flight(in_flight))
                in_flight = None

        def masks():
            settle()  # a row that has just ended is no longer constrained: its token is dropped
            groups = [(None, [], None) if r.finished else (r.grammar, [], self._ban(r)) for r in sampled]
            return step_bitmask(groups, self.model_config.vocab_size)

        def sampling() -> SamplingTensors:
            settle()
            return sampling_tensors(sampled, device)

        out = self._sample(batch, sampled, masks, sampling)
        for req, n in step.extends:
            req.num_computed += n
        for req in step.decodes:
            if not req.finished:  # (ended as the step in flight was committed)
                req.num_computed += 1
        if self._overlap:
            self._in_flight = self._hold(step, sampled, out)
            self._overlapped += 1
            settle()
            return settled
        return self._commit(self._row_results(sampled, _read_back(out)))

    def _ban(self, req: Request) -> Ban | None:
        """While ``req`` is short of its ``min_tokens``: its stop tokens (EOS unless ``ignore_eos``, and
        its ``stop_token_ids``), banned from that many of its next positions. EOS ids past the
        vocabulary (a tokenizer's or generation config's) cannot be sampled and are left out."""
        short = req.num_banned_positions
        if not short:
            return None
        tokens = self._stop_tokens(req.params)
        return (tokens, short) if tokens else None

    def _stop_tokens(self, params: SamplingParams) -> tuple[int, ...]:
        """The tokens ``min_tokens`` bans: EOS unless ``ignore_eos``, and ``stop_token_ids``."""
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(sorted(t for t in {*eos, *params.stop_token_ids} if t < self.model_config.vocab_size))

    def _complete_in_flight(self) -> list[RequestOutput]:
        """With nothing left to launch: the step in flight, read and committed."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        outputs = self._commit_in_flight(in_flight)
        self.scheduler.cache_pages(in_flight.step)
        return outputs

    def _commit_in_flight(self, in_flight: _InFlight) -> list[RequestOutput]:
        return self._commit(self._row_results(in_flight.sampled, in_flight.host), in_flight.slots)

    def _sample(self, batch, sampled: list[Request], masks, sampling) -> SamplerOutput:
        """Launches the forward and the pick of every logits row; the ids stay on the device."""
        if plain_greedy(sampled):  # no sampling tensors, and on a DECODE key its greedy head graph
            return SamplerOutput(self.runner.run_greedy(batch), None, None, None)
        return self.runner.run(batch, sampling, masks)

    def _hold(self, step: ScheduledStep, sampled: list[Request], out: SamplerOutput) -> _InFlight:
        """Leaves a launched step's ids on the device: each logits row's request holds a placeholder
        for its token (read by the next call, ``_commit``) and feeds it to its next step from there."""
        slots = []
        for row, req in enumerate(sampled):
            slots.append(len(req.token_ids))
            if req.finished:  # ended as the step before was committed: its row is dropped
                continue
            req.token_ids.append(PENDING)
            req.num_pending += 1
            req.pending_row = row
            req.final_pending = self._ends_by_length(req, len(req.token_ids))
        return _InFlight(step, sampled, slots, out.token_ids, _read_back(out, behind=True), self.runner.replayed)

    def _row_results(self, sampled: list[Request], host: Readback) -> list[RowResult]:
        token_ids, logprobs, top_ids, top_logprobs = host.lists()
        results = []
        for row, (req, token) in enumerate(zip(sampled, token_ids)):
            lp = None
            if req.params.logprobs is not None:
                n = req.params.logprobs
                lp = [TokenLogprob(token, logprobs[row], list(zip(top_ids[row][:n], top_logprobs[row][:n])))]
            results.append(RowResult(req, [token], lp, None))
        return results

    def _commit(self, results: list[RowResult], slots: list[int] | None = None) -> list[RequestOutput]:
        """Appends each row's emitted tokens in order, stopping at the first that finishes it; with
        ``slots`` (an overlapped step: one token a row), each token replaces its placeholder at that
        index of the request's ``token_ids``. A row whose request ended while its step was in flight is
        dropped. The text is decoded token by token where a stop string may end it, else once for a
        row's kept tokens (a verify row emits up to 1 + k)."""
        outputs = []
        eos = self.eos_token_ids
        for i, res in enumerate(results):
            req = res.request
            if req.finished:
                continue
            if res.num_accepted is not None:
                req.num_drafted += res.num_drafted
                req.num_accepted += res.num_accepted
            new: list[int] = []
            stops = req.detokenizer.stop
            for j, token in enumerate(res.tokens):
                end = len(req.token_ids) + 1 if slots is None else slots[i] + 1
                try:
                    terminated = req.grammar is not None and req.grammar.accept([token])
                except GrammarDeadEnd as exc:  # its row had every logit masked: the token means nothing
                    log.warning("request %r: %s after %d tokens; it is aborted", req.request_id, exc,
                                end - 1 - len(req.prompt_token_ids))
                    self._finish(req, "abort", end - 1)
                    break
                if slots is None:
                    req.token_ids.append(token)
                else:
                    req.token_ids[end - 1] = token
                    req.num_pending -= 1
                new.append(token)
                if res.logprobs is not None:
                    req.logprobs.append(res.logprobs[j])
                stop_string = (req.detokenizer.add([token], end - len(req.prompt_token_ids) > req.params.min_tokens)
                               if stops and token not in eos else None)
                reason = self._finish_reason(req, token, stop_string, end)
                if terminated and reason is None:
                    reason = "stop"  # the grammar has terminated
                if reason is not None:
                    self._finish(req, reason, end)
                    break
            if not stops:
                req.detokenizer.add_many([token for token in new if token not in eos])
            if not req.finished and res.num_accepted is not None:
                self.kv.trim(req.request_id, len(req.token_ids))  # pages past the accepted length
            outputs.append(self._output(req, new))
        return outputs

    def _finish(self, req: Request, reason: str, end: int) -> None:
        """Ends the request at its token ``end - 1``; any placeholder after it is dropped."""
        if req.num_pending:
            req.drop_pending()
            req.num_computed = min(req.num_computed, end - 1)
        self.scheduler.remove(req)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]

    def _finish_reason(self, req: Request, token: int, stop_string: str | None, end: int) -> str | None:
        """Why the request ends at its token ``end - 1`` (``token``), if it does."""
        params = req.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if stop_string is not None:
            return "stop"
        if self._ends_by_length(req, end):
            return "length"
        return None

    def _ends_by_length(self, req: Request, end: int) -> bool:
        """Whether the request's token ``end - 1`` is its last by ``max_tokens`` or the context."""
        return end - len(req.prompt_token_ids) >= req.params.max_tokens or end >= self.max_model_len

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sequence=req.token_ids,
            num_output_tokens=req.num_committed - len(req.prompt_token_ids),
            text=req.detokenizer.text,
            new_token_ids=new_tokens,
            new_text=req.detokenizer.take_delta(req.finished),
            finished=req.finished,
            finish_reason=req.finish_reason,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            num_draft_tokens=req.num_drafted,
            num_accepted_tokens=req.num_accepted,
            num_cached_tokens=req.num_cached_tokens,
        )

    # ---- batch use ------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, per_prompt):
                self.add_request(rid, prompt, p)
        except ValueError:
            for rid in ids:
                req = self.requests.pop(rid, None)
                if req is not None:
                    self.scheduler.remove(req)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def stats(self) -> dict:
        return {
            "steps": dict(self._steps),
            "kv_pages_free": self.kv.num_free_pages,
            "kv_pages_total": self.kv.num_total_pages,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self._preemptions,
            "overlapped_steps": self._overlapped,
            # Wall time inside step() calls: scheduling, launches and (overlapped) the wait for the
            # step before; over the steps it took, the engine's own time per step.
            "step_seconds": self._step_seconds,
            "kv_pages_cached": self.kv.num_cached_pages,
            "prefix_cache_query_tokens": self.scheduler.prefix_query_tokens,
            "prefix_cache_hit_tokens": self.scheduler.prefix_hit_tokens,
            "prefix_cache_deferrals": self.scheduler.prefix_deferrals,
            **self.runner.graph_stats(),
            **(self.speculator.stats() if self.speculator is not None else {}),
        }


def _read_back(out: SamplerOutput, behind: bool = False) -> Readback:
    """A step's sampled ids and logprobs for the host (``behind``: overlapped steps, module docstring)."""
    return Readback((out.token_ids, out.logprobs, out.top_ids, out.top_logprobs), behind)


@dataclass(slots=True)
class _InFlight:
    """A launched step whose sampled ids are still on the device (module docstring)."""

    step: ScheduledStep
    sampled: list[Request]  # per logits row
    slots: list[int]  # per logits row: where its placeholder sits in the request's token_ids
    token_ids: torch.Tensor  # [N] on the device: what the next step's decode rows read
    host: Readback
    replayed: bool  # its forward replayed a CUDA graph

    @property
    def first_tokens(self) -> bool:
        """Whether some row completed its prompt (prefill rows' logits rows come first)."""
        return len(self.sampled) > len(self.step.decodes)
