"""Speculative decoding inside the engine step: verify rows, acceptance, and model drafting.

Verify rows are decode rows of ``q_len_per_req = 1 + k`` fed ``[last token, d_1 .. d_k]``; prefill
rows in the same step are sampled as usual (as verify rows with k = 0, one code path). Drafts come
from a host drafter (n-gram lookup, replay) proposed before the step, or from a model drafter (the
checkpoint's MTP layer, or an EAGLE-3 draft model: drafters.py) run right after the target forward,
on device, with no host sync in between:

1. the drafter's first pass sees the step's own layout — prefill rows (so its KV covers new prompts)
   and every one of the 1 + k positions of each verify row, fed the target's hidden states (MTP: the
   final-normed state; EAGLE-3: its auxiliary states) and the tokens shifted by one (the verdict's
   tokens, rejected positions included: padded speculation, their KV is overwritten later) — and
   reads its first draft at each row's own accepted position;
2. draft steps 2..k are decode-only q_len-1 steps whose positions, lengths and cache slots are
   advanced on the GPU.

A model drafter writes KV up to k - 1 positions past the step's tokens: the scheduler reserves
``lookahead = k - 1`` extra slots for it.

A step whose rows are all greedy (and penalty-free) needs no distributions: its tokens are the
target's argmax and verification compares drafts with them (``verify_greedy``), and its drafts are
the drafter's argmax. A step with a sampling row draws its drafts from the drafter's processed
distributions and keeps them for the next step's verification. A DECODE step that replayed the
target's graph and has no penalties, logprobs, grammar or opted-out rows verifies in one replay of
that key's greedy or stochastic head graph (engine/head_graphs.py); any step that replayed a key
drafts in one replay of the drafter's graph for it, greedy or stochastic (draft_graphs.py).

The verdict (each row's accepted count and tokens) comes back in one device-to-host copy, issued before
the draft is launched, so the host commits the step and builds the next while the device drafts. A
model drafter's drafts stay on the device and feed the next step's verify rows from there
(``build_forward_batch``'s ``drafts``). Where a grammar's mask or penalties read them, they are copied
to the host behind the draft and waited for once the next forward is launched; where a drafting row is
missing from the next step, they are read back before it is built (``prepare``). Such steps are counted
in ``drafts_read_back``. Logprobs, when asked for, come back in two more copies, after the draft.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from encore.backends.argmax import argmax_rows
from encore.backends.host_tensors import Readback, upload
from encore.backends.metadata import ForwardBatch, ForwardMode
from encore.engine.head_graphs import plain_rows
from encore.engine.kv_cache import DUMMY_PAGE
from encore.engine.request import Request, TokenLogprob
from encore.engine.sampler import SamplingTensors, needs_token_history, processed_probs, sample_from_probs
from encore.engine.scheduler import ScheduledStep
from encore.engine.spec.acceptance import DRAFT_SALT, Verdict, verify, verify_greedy
from encore.engine.spec.config import SpecConfig
from encore.engine.spec.draft_graphs import DraftGraphs
from encore.engine.spec.drafters import model_drafter
from encore.engine.spec.ngram import NgramDrafter
from encore.engine.spec.replay import ReplayDrafter
from encore.engine.step import DeviceDrafts
from encore.graphs.compiler import CompiledDrafter


@dataclass(slots=True)
class RowResult:
    request: Request
    tokens: list[int]  # emitted this step, in order
    logprobs: list[TokenLogprob] | None
    num_accepted: int | None  # drafts accepted (verify rows only)
    num_drafted: int = 0  # drafts that counted: k, or 0 for a request that opted out


class Speculator:
    def __init__(self, cfg: SpecConfig, runner, vocab_size: int) -> None:
        self.cfg = cfg
        self.k = cfg.num_speculative_tokens
        self.runner = runner
        self.model_drafter = model_drafter(cfg.method, runner)
        if cfg.method == "ngram":
            self.host_drafter = NgramDrafter(self.k, cfg.ngram_min, cfg.ngram_max)
        elif cfg.method == "replay":
            self.host_drafter = ReplayDrafter(self.k, cfg.continuations or {}, cfg.error_rate, vocab_size)
        else:
            self.host_drafter = None
        self.lookahead = self.k - 1 if self.model_drafter is not None else 0
        self._offsets = torch.arange(1, self.k + 1, device=runner.device)[:, None]  # [k, 1]: draft steps ahead
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] of a stochastic model draft
        self._last_drafts: _Drafted | None = None  # the last step's model drafts, on the device
        # This step's drafts on their way to the host, and its rows fed them (request, row): host_drafts
        self._drafts_copy: tuple[Readback, list[tuple[Request, int]]] | None = None
        self.drafts_read_back = 0  # steps that read a model draft to the host (prepare)
        self.drafted = 0
        self.accepted = 0
        self.verify_rows = 0
        self.drafter_eager_steps = 0  # steps whose draft ran eager (a first pass and k - 1 draft steps)
        self.verify_eager_steps = 0  # steps with verify rows whose verdict no head graph computed
        self.draft_graphs = None
        self.compiled_drafter = None
        graphs = runner.graphs
        if self.model_drafter is not None and graphs is not None and graphs.cuda_graphs:
            if graphs.compiled is not None:
                self.compiled_drafter = CompiledDrafter(self.model_drafter.forward,
                                                        graphs.compiled.passes_for(ForwardMode.DECODE),
                                                        compile_threads=graphs.compiled.compile_threads,
                                                        artifact=runner.graph_cache.drafter_artifact,
                                                        pools=runner.kv_pools)
            self.draft_graphs = DraftGraphs(graphs, self.k, vocab_size, self._graph_draft, runner.heads.tokens,
                                            runner.heads.accepted)
            with runner.graph_cache.active():  # the drafter's compile work goes in the graph cache too
                self.draft_graphs.capture()

    @property
    def q_len(self) -> int:
        return 1 + self.k

    def prepare(self, step: ScheduledStep) -> DeviceDrafts | None:
        """Drafts for this step's verify rows: a model drafter's, made by the step before, stay on the
        device and are returned for ``build_forward_batch`` to feed, unless a drafting row is left out
        of this step (then every drafting row's are read to the host now, waiting for the draft); where
        a grammar's mask or penalties read them, a copy to the host starts behind the draft, waited for
        by ``host_drafts`` once the forward is launched. Host drafters propose here. A row no drafter
        has drafted for (it cannot happen in steady state) repeats its last token, which is simply
        rejected. A request that opted out (``SamplingParams.speculative=False``) keeps the verify
        row's shape with placeholder drafts that ``run`` caps at zero accepted."""
        drafted, self._last_drafts = self._last_drafts, None
        self._drafts_copy = None
        if drafted is not None and _left_out(step, drafted):
            for req, drafts in zip(drafted.requests, drafted.drafts.tolist()):
                req.draft_token_ids = drafts
            self.drafts_read_back += 1
            drafted = None
        rows = {req.request_id: i for i, req in enumerate(drafted.requests)} if drafted is not None else {}
        on_device: dict[str, int] = {}
        for req in step.decodes:
            if req.params.speculative is False:
                req.draft_token_ids = [req.token_ids[-1]] * self.k
            elif self.host_drafter is not None:
                req.draft_token_ids = self.host_drafter.propose(req)
            elif req.request_id in rows:
                on_device[req.request_id] = rows[req.request_id]
                req.draft_token_ids = []  # a later step without them falls back to the placeholder
            elif len(req.draft_token_ids) != self.k:
                req.draft_token_ids = [req.token_ids[-1]] * self.k
        if not on_device:
            return None
        if _reads_drafts(step):
            fed = [(req, on_device[req.request_id]) for req in step.decodes if req.request_id in on_device]
            self._drafts_copy = (Readback([drafted.drafts], behind=True), fed)
            self.drafts_read_back += 1
        return DeviceDrafts(drafted.drafts, on_device)

    def host_drafts(self) -> None:
        """The drafts of this step's rows fed from the device, on the host (``Request.draft_token_ids``)
        where ``prepare`` found that a grammar's mask or penalties read them: called once the step's
        forward is launched, it waits for the draft of the step before, not for the forward."""
        if self._drafts_copy is None:
            return
        copy, fed = self._drafts_copy
        self._drafts_copy = None
        drafts = copy.lists()[0]
        for req, row in fed:
            req.draft_token_ids = drafts[row]

    def forget(self, request_id: str) -> None:
        self.draft_probs.pop(request_id, None)

    @torch.inference_mode()
    def run(self, step: ScheduledStep, batch: ForwardBatch, sampled: list[Request], masks=None) -> list[RowResult]:
        """``masks`` builds the grammar bitmask of the step's logits rows (see ModelRunner.run)."""
        runner, k, q_len = self.runner, self.k, self.q_len
        device = runner.device
        n_plain = len(sampled) - len(step.decodes) * q_len
        rows = len(step.decodes)
        counted = [0 if r.params.speculative is False else k for r in step.decodes]
        # How many drafts each row may accept, uploaded only when a row opted out.
        caps = upload([(counted, torch.long)], device)[0] if 0 in counted else None
        params = [r.params for r in sampled]
        greedy = all(p.greedy for p in params) and not needs_token_history(params)
        hidden = runner.forward(batch)  # [T, hidden]
        logits = None
        if self._verified_in_head(batch, sampled, caps, greedy, step.decodes):
            plain_tokens = batch.input_ids.new_zeros(0)
            spec = Verdict(runner.heads.accepted[:rows], runner.heads.tokens[:rows * q_len].view(rows, q_len))
        else:
            if rows:
                self.verify_eager_steps += 1
            # Each verify row was fed its last token and its k drafts (those left on the device by the
            # step before are written into the unpadded ids here; a replay wrote them into its own).
            batch.resolve_pending()
            drafts = batch.input_ids[batch.num_extend_tokens:].view(rows, q_len)[:, 1:]  # [B, k]
            logits = runner.model.compute_logits(hidden[batch.gather_ids])  # [N, V]
            runner.apply_masks(logits, masks)
            if greedy:
                choice = argmax_rows(logits)  # [N]: every row's token is the target's argmax
                plain_tokens = choice[:n_plain]
                spec = verify_greedy(choice[n_plain:].view(rows, q_len), drafts, caps)
            else:
                self.host_drafts()  # penalties read the drafts
                t = self._target_tensors(sampled, n_plain, step.decodes, device)
                probs = processed_probs(logits, t)  # [N, V]
                plain_tokens = (verify(probs[:n_plain, None], drafts.new_zeros(n_plain, 0), None, t.seeds[:n_plain],
                                       t.counters[:n_plain]).tokens[:, 0] if n_plain else drafts.new_zeros(0))
                spec = verify(probs[n_plain:].view(rows, q_len, probs.shape[-1]), drafts,
                              self._draft_q(step.decodes, drafts), t.seeds[n_plain::q_len],
                              t.counters[n_plain::q_len], caps)
        # The verdict in one device-to-host copy, queued before the draft: read while the device drafts.
        verdict = Readback([torch.cat([plain_tokens, spec.num_accepted, spec.tokens.flatten()])], behind=True)
        if self.model_drafter is not None:
            drafting, drafts = self._model_draft(step, batch, sampled[:n_plain], hidden, plain_tokens, spec,
                                                 in_buffers=logits is None)
            if drafting:
                # A copy: a draft graph's output lies in the graphs' memory pool, which the next step's
                # target replay may write over (draft_graphs.py captures after the target's graphs).
                self._last_drafts = _Drafted(drafts.clone(), drafting)
        host = verdict.lists()[0]
        plain_host, host = host[:n_plain], host[n_plain:]
        accepted, host = host[:rows], host[rows:]
        spec_tokens = [host[b * q_len:(b + 1) * q_len] for b in range(rows)]
        results = [RowResult(req, [plain_host[i]], None, None) for i, req in enumerate(sampled[:n_plain])]
        for b, req in enumerate(step.decodes):
            a = accepted[b]
            results.append(RowResult(req, spec_tokens[b][:a + 1], None, a, counted[b]))
            if counted[b]:
                self.drafted += counted[b]
                self.accepted += a
                self.verify_rows += 1
        if logits is not None:
            # Each row's logits rows: a plain row's own, a verify row's first 1 + accepted.
            firsts = list(range(n_plain)) + [n_plain + b * q_len for b in range(rows)]
            _read_logprobs(logits, [(res, range(first, first + len(res.tokens)))
                                    for res, first in zip(results, firsts)])
        return results

    def _verified_in_head(self, batch: ForwardBatch, sampled: list[Request], caps: torch.Tensor | None,
                          greedy: bool, decodes: list[Request]) -> bool:
        """Replays a head graph of the DECODE key the step just replayed, where none of its rows opted
        out (no caps) and each needs only its processed distribution (``plain_rows``): the greedy head
        where all are ``greedy``, else the stochastic verify head. The verdict is then in the heads'
        buffers, where the draft graph reads it (engine/head_graphs.py). False where none ran."""
        if caps is not None or not plain_rows(sampled):
            return False
        if greedy:
            return self.runner.replay_head(batch)
        rows = [(r.params, r.seed, r.num_output_tokens + j) for r in decodes for j in range(self.q_len)]
        return self.runner.replay_head(batch, rows, [self.draft_probs.get(r.request_id) for r in decodes])

    def _target_tensors(self, sampled: list[Request], n_plain: int, decodes: list[Request],
                        device: torch.device) -> SamplingTensors:
        """Per logits row: the j-th row of a verify row samples the token after j accepted drafts,
        so its counter and the output tokens its penalties see include d_1 .. d_j."""
        params = [r.params for r in sampled]
        history = needs_token_history(params)  # copy token lists only when penalties read them
        counters = [r.num_output_tokens for r in sampled[:n_plain]]
        outputs = [r.output_token_ids if history else () for r in sampled[:n_plain]]
        for req in decodes:
            for j in range(self.q_len):
                counters.append(req.num_output_tokens + j)
                outputs.append(req.output_token_ids + req.draft_token_ids[:j] if history else ())
        return SamplingTensors.build(params, [r.seed for r in sampled], counters,
                                     [r.prompt_token_ids if history else () for r in sampled], outputs, device)

    def _draft_q(self, decodes: list[Request], drafts: torch.Tensor) -> torch.Tensor | None:
        """Draft distributions for stochastic model drafts; None means one-hot at the drafts."""
        if not any(r.request_id in self.draft_probs for r in decodes):
            return None
        vocab = next(iter(self.draft_probs.values())).shape[-1]
        one_hot = torch.nn.functional.one_hot(drafts, vocab).float()  # [B, k, V]
        return torch.stack([self.draft_probs.get(r.request_id, one_hot[b]) for b, r in enumerate(decodes)])

    def _model_draft(self, step: ScheduledStep, batch: ForwardBatch, completing: list[Request], hidden: torch.Tensor,
                     plain_tokens: torch.Tensor, spec: Verdict, in_buffers: bool) -> tuple[list[Request], torch.Tensor]:
        """The drafting rows (``completing``: the prefill rows that complete their prompt, then the
        verify rows) and their k drafts [D, k]. ``in_buffers``: the verdict is already in the draft
        graphs' buffers (the head graph wrote it)."""
        k, q_len = self.k, self.q_len
        device = self.runner.device
        drafting = completing + step.decodes
        # A row that opted out has its drafts replaced (``prepare``): any pick serves it.
        greedy = all(r.params.greedy or r.params.speculative is False for r in drafting)
        # Tokens shifted by one: position i is fed the token at i + 1.
        shifted: list[int] = []
        fill_at: list[int] = []  # positions whose next token is this step's sampled token
        src_rows: list[int] = []
        for row, (req, n) in enumerate(step.extends):
            start, end = req.num_computed, req.num_computed + n
            shifted.extend(req.token_ids[start + 1:end + 1])
            if end == len(req.token_ids):
                fill_at.append(len(shifted))
                shifted.append(0)
                src_rows.append(row)
        # Per drafting row: (params, seed, prompt length), how its drafts are drawn; None when all are greedy.
        sampling = None if greedy else [(r.params, r.seed, len(r.prompt_token_ids)) for r in drafting]
        if self.draft_graphs is not None:
            key = self.runner.graphs.last_replayed
            drafts = (self.draft_graphs.run_prefill(key, shifted, list(zip(src_rows, fill_at)), plain_tokens, spec,
                                                    sampling)
                      if step.extends else
                      self.draft_graphs.run(key, len(step.decodes), None if in_buffers else spec, sampling))
            if drafts is not None:
                if sampling is not None:  # the graph's buffer is rewritten by its next replay
                    self._keep_draft_probs(drafting, self.draft_graphs.probs[:len(drafting)].clone())
                return drafting, drafts
        self.drafter_eager_steps += 1
        te = len(shifted)
        # The drafting rows' sampling parameters go in the same copy (their counters: prompt lengths).
        floats, longs = SamplingTensors.penalty_free_rows(sampling, len(drafting)) if sampling else ([], [])
        shifted_d, fill_at_d, src_rows_d, floats_d, longs_d = upload(
            [(shifted, torch.long), (fill_at, torch.long), (src_rows, torch.long), (floats, torch.float32),
             (longs, torch.long)], device)
        ids = torch.empty(batch.num_tokens, dtype=torch.long, device=device)
        ids[:te] = shifted_d
        if fill_at:
            ids[fill_at_d] = plain_tokens
        ids[te:] = spec.tokens.flatten()  # padded speculation: all 1 + k positions of each verify row
        if not drafting:  # only partial prefill chunks: the pass fills the drafter's KV, nothing to draft yet
            self._drafter_pass(self.model_drafter.forward, batch, ids, self.model_drafter.first_input(hidden))
            return drafting, torch.zeros(0, k, dtype=torch.long, device=device)
        rows = len(step.decodes)
        src = torch.cat([fill_at_d,
                         te + torch.arange(rows, device=device) * q_len + spec.num_accepted])  # [D]
        src_row = torch.cat([src_rows_d,
                             batch.num_extends + torch.arange(rows, device=device)])
        steps, page_table = self._draft_steps(batch.page_table[src_row])  # [D, P]
        draft_sampling = None if sampling is None else SamplingTensors.in_buffers(
            floats_d.view(6, -1), longs_d.view(3, -1), any(params.truncates for params, _, _ in sampling))
        drafts, probs = self._draft(batch, ids, hidden, src, batch.positions[src], page_table, draft_sampling,
                                    self.model_drafter.forward, steps)
        if probs is not None:
            self._keep_draft_probs(drafting, probs)
        return drafting, drafts

    def _keep_draft_probs(self, drafting: list[Request], probs: torch.Tensor) -> None:
        """Keeps each stochastic drafting row's k distributions (``probs`` [D, k, V]) for its verification."""
        for i, req in enumerate(drafting):
            if not req.params.greedy and req.params.speculative is not False:  # a cap of 0 never reads q
                self.draft_probs[req.request_id] = probs[i]

    def _graph_draft(self, static: ForwardBatch, ids: torch.Tensor, hidden: torch.Tensor, src: torch.Tensor,
                     positions: torch.Tensor, page_table: torch.Tensor, sampling: SamplingTensors | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft of a key's static step, as its draft graphs capture it (draft_graphs.py).
        The backend's plan for the step is already in place (made before the target's replay). The
        compiled drafter takes decode-only passes: a first pass over prefill rows runs the eager module."""
        steps = self.compiled_drafter or self.model_drafter.forward
        first = steps if static.mode is ForwardMode.DECODE else self.model_drafter.forward
        return self._draft(static, ids, hidden, src, positions, page_table, sampling, first, steps, plan_first=False)

    def _draft_steps(self, page_table: torch.Tensor) -> tuple[Callable, torch.Tensor]:
        """How an eager draft runs its decode-only steps 2..k, and the table [D, P'] they read: on the
        compiled drafter where there is one, with the table padded to the width it was compiled for
        (the graphs' tables), else eager on ``page_table`` [D, P] itself."""
        compiled = self.compiled_drafter
        width = self.runner.graphs.buffers.max_pages if compiled is not None else 0
        if compiled is None or page_table.shape[1] > width:
            return self.model_drafter.forward, page_table
        return compiled, torch.nn.functional.pad(page_table, (0, width - page_table.shape[1]), value=DUMMY_PAGE)

    def _draft(self, batch: ForwardBatch, ids: torch.Tensor, target_hidden: torch.Tensor, src: torch.Tensor,
               positions: torch.Tensor, page_table: torch.Tensor, sampling: SamplingTensors | None, first: Callable,
               steps: Callable, plan_first: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k drafts [D, k] for the rows whose first-pass states sit at tokens ``src`` [D] of ``batch``,
        at ``positions`` [D] (pages ``page_table`` [D, P]): the drafter's argmax, or with ``sampling`` (the
        rows' parameters, penalties off, counters holding their prompt lengths) each row's draw from its
        processed draft distribution, those distributions [D, k, V] returned too.
        ``first`` runs the first drafter pass, ``steps`` each decode-only step after it."""
        drafter = self.model_drafter
        qs = []

        def pick(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            if sampling is None:
                return drafter.greedy(hidden)
            # The draft at ``positions`` + 2 is its request's output token of that index.
            t = replace(sampling, counters=positions + 2 - sampling.counters)
            q = processed_probs(drafter.logits(hidden), t)  # [D, V]
            qs.append(q)
            return torch.where(t.temperature == 0, argmax_rows(q),
                               sample_from_probs(q, t.seeds, t.counters, DRAFT_SALT))

        h = self._drafter_pass(first, batch, ids, drafter.first_input(target_hidden), plan_first)[src]  # [D, H]
        drafts = [pick(h, positions)]
        for step in _later_draft_steps(positions, page_table, batch.page_size, self._offsets, drafts):
            h = self._drafter_pass(steps, step, step.input_ids, h)
            drafts.append(pick(h, step.positions))
        return torch.stack(drafts, dim=1), (torch.stack(qs, dim=1) if qs else None)

    def _drafter_pass(self, forward: Callable, batch: ForwardBatch, ids: torch.Tensor, hidden: torch.Tensor,
                      plan: bool = True) -> torch.Tensor:
        """One drafter pass over ``batch``, with the step context bound (and the backend planned,
        unless ``plan`` is False: a plan already in place) when its attention reads it."""
        if not self.model_drafter.uses_step_context:
            return forward(batch, ids, hidden)
        with self.runner.context.bind(batch):
            if plan:
                self.runner.backend.plan(batch)
            return forward(batch, ids, hidden)

    def stats(self) -> dict:
        return {
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "spec_mean_accepted_length": 1 + self.accepted / self.verify_rows if self.verify_rows else 0.0,
            "drafter_eager_steps": self.drafter_eager_steps,
            "drafts_read_back": self.drafts_read_back,
            "verify_eager_steps": self.verify_eager_steps,
            "drafter_graph_replays": self.draft_graphs.replays if self.draft_graphs is not None else 0,
            "drafter_compiles": self.compiled_drafter.record.compiles if self.compiled_drafter is not None else 0,
            "drafter_loaded": self.compiled_drafter is not None and self.compiled_drafter.record.loaded,
        }


@dataclass(slots=True)
class _Drafted:
    """A step's model drafts, left on the device for the next step (``Speculator.prepare``)."""

    drafts: torch.Tensor  # [D, k], row i the drafts of requests[i]
    requests: list[Request]  # the drafting rows


def _left_out(step: ScheduledStep, drafted: _Drafted) -> bool:
    """Whether a row of ``drafted`` that has not finished is not one of ``step``'s verify rows (its
    drafts, on the host, wait for its next verify step)."""
    scheduled = {req.request_id for req in step.decodes}
    return any(not req.finished and req.request_id not in scheduled for req in drafted.requests)


def _reads_drafts(step: ScheduledStep) -> bool:
    """Whether a grammar's mask or penalties read the drafts of ``step``'s verify rows on the host."""
    return (any(req.grammar is not None for req in step.decodes)
            or needs_token_history([req.params for req in step.decodes] + [req.params for req, _ in step.extends]))


def _read_logprobs(logits: torch.Tensor, rows: list[tuple[RowResult, range]]) -> None:
    """Fills in the logprobs of each result whose request asked for them: its emitted tokens' and its top
    n at each of its logits rows (``logits`` [N, V] rows). One log_softmax, gather and top-k over the
    step's rows that are read (not all N), and two reads back (a read per row made the host wait on the
    device three times a row)."""
    asked = [(res, at) for res, at in rows if res.request.params.logprobs is not None]
    if not asked:
        return
    index, chosen_ids = upload([([i for _, at in asked for i in at], torch.long),
                                ([t for res, _ in asked for t in res.tokens], torch.long)], logits.device)
    picked = torch.log_softmax(logits[index], dim=-1)  # [M, V]
    top_vals, top_ids = picked.topk(max(1, max(res.request.params.logprobs for res, _ in asked)), dim=-1)
    values = torch.cat([picked.gather(1, chosen_ids[:, None]), top_vals], dim=1).tolist()  # [M, 1 + n]
    ids = top_ids.tolist()
    m = 0
    for res, _ in asked:
        n = res.request.params.logprobs
        res.logprobs = [TokenLogprob(t, values[m + j][0], list(zip(ids[m + j][:n], values[m + j][1:1 + n])))
                        for j, t in enumerate(res.tokens)]
        m += len(res.tokens)


def _later_draft_steps(positions: torch.Tensor, page_table: torch.Tensor, page_size: int, offsets: torch.Tensor,
                       drafts: list[torch.Tensor]) -> Iterator[ForwardBatch]:
    """Draft steps 2..k of rows whose first draft is read at ``positions`` [D]: decode-only q_len-1 steps
    built on the device (no host reads), step s at ``positions`` + s and fed ``drafts[-1]``, each token's
    cache slot looked up in its row's pages ``page_table`` [D, P]. ``offsets`` = [1 .. k] as a [k, 1]
    column. The fields of every step come from one pass of small kernels over all of them (about ten, where
    one step's alone took eleven); ``drafts`` is read as each step is taken, so the caller appends a step's
    draft before asking for the next."""
    steps = offsets.shape[0] - 1
    if steps == 0:
        return
    rows = positions.shape[0]
    # [k, D]: row s - 1 holds step s's positions, row s its lengths
    ahead = torch.add(positions[None, :], offsets, out=_past_offset_one(steps + 1, rows, positions))
    lengths = ahead.to(torch.int32)
    pages = page_table.gather(1, (ahead[:steps] // page_size).t()).t()  # [k - 1, D]
    slots = torch.add(pages * page_size, ahead[:steps] % page_size, out=_past_offset_one(steps, rows, positions))
    qo_indptr = torch.arange(rows + 1, dtype=torch.int32, device=positions.device)
    gather_ids = qo_indptr[:rows].long()
    for s in range(steps):
        yield ForwardBatch(num_extends=0, q_len_per_req=1, bs=rows, num_tokens=rows, page_size=page_size,
                           input_ids=drafts[-1], positions=ahead[s], slot_mapping=slots[s], seq_lens=lengths[s + 1],
                           prefix_lens=lengths[s], qo_indptr=qo_indptr, page_table=page_table,
                           gather_ids=gather_ids, seq_lens_cpu=[], prefix_lens_cpu=[])


def _past_offset_one(n: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    """An empty [n, rows] tensor of ``like``'s dtype and device whose rows all start at storage offset 2
    or more. The compiled drafter's first pass reads positions and slots from views far into the graph
    buffers; dynamo specializes a storage offset of 0 or 1, so a draft step whose row sat at 0 (or, with
    one row, at 1) would compile the drafter a second time."""
    return like.new_empty(2 + n * rows)[2:].view(n, rows)
