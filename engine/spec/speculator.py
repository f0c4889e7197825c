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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from encore.backends.metadata import ForwardBatch
from encore.engine.request import Request, TokenLogprob
from encore.engine.sampler import SamplingTensors, needs_token_history, processed_probs, sample_from_probs
from encore.engine.scheduler import ScheduledStep
from encore.engine.spec.acceptance import DRAFT_SALT, verify
from encore.engine.spec.config import SpecConfig
from encore.engine.spec.drafters import model_drafter
from encore.engine.spec.ngram import NgramDrafter
from encore.engine.spec.replay import ReplayDrafter

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
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] of a stochastic model draft
        self.drafted = 0
        self.accepted = 0
        self.verify_rows = 0

    @property
    def q_len(self) -> int:
        return 1 + self.k

    def prepare(self, step: ScheduledStep) -> None:
        """Host drafters propose for this step's verify rows; a row a model drafter has not drafted
        for (it cannot happen in steady state) repeats its last token, which is simply rejected. A
        request that opted out (``SamplingParams.speculative=False``) keeps the verify row's shape with
        placeholder drafts that ``run`` caps at zero accepted."""
        for req in step.decodes:
            if req.params.speculative is False:
                req.draft_token_ids = [req.token_ids[-1]] * self.k
            elif self.host_drafter is not None:
                req.draft_token_ids = self.host_drafter.propose(req)
            elif len(req.draft_token_ids) != self.k:
                req.draft_token_ids = [req.token_ids[-1]] * self.k

    def forget(self, request_id: str) -> None:
        self.draft_probs.pop(request_id, None)

    @torch.inference_mode()
    def run(self, step: ScheduledStep, batch: ForwardBatch, sampled: list[Request], masks=None) -> list[RowResult]:
        """``masks`` builds the grammar bitmask of the step's logits rows (see ModelRunner.run)."""
        runner, k, q_len = self.runner, self.k, self.q_len
        device = runner.device
        n_plain = len(sampled) - len(step.decodes) * q_len
        hidden = runner.forward(batch)  # [T, hidden]
        logits = runner.model.compute_logits(hidden[batch.gather_ids])  # [N, V]
        runner.apply_masks(logits, masks)
        t = self._target_tensors(sampled, n_plain, step.decodes, device)
        probs = processed_probs(logits, t)  # [N, V]
        plain = verify(probs[:n_plain, None], torch.zeros(n_plain, 0, dtype=torch.long, device=device), None,
                       t.seeds[:n_plain], t.counters[:n_plain])
        rows = len(step.decodes)
        drafts = torch.tensor([r.draft_token_ids for r in step.decodes], dtype=torch.long,
                              device=device).view(rows, k)
        counted = [0 if r.params.speculative is False else k for r in step.decodes]  # drafts each row may accept
        caps = torch.tensor(counted, device=device) if 0 in counted else None
        spec = verify(probs[n_plain:].view(rows, q_len, probs.shape[-1]), drafts, self._draft_q(step.decodes, drafts),
                      t.seeds[n_plain::q_len], t.counters[n_plain::q_len], caps)
        new_drafts = (self._model_draft(step, batch, hidden, plain.tokens[:, 0], spec)
                      if self.model_drafter is not None else None)
        want_logprobs = any(r.params.logprobs is not None for r in sampled)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # [N, V]
        plain_tokens = plain.tokens[:, 0].tolist()
        accepted = spec.num_accepted.tolist()
        spec_tokens = spec.tokens.tolist()
        results = []
        for i, req in enumerate(sampled[:n_plain]):
            results.append(RowResult(req, [plain_tokens[i]], self._logprobs(logprobs, req, [i], [plain_tokens[i]]),
                                     None))
        for b, req in enumerate(step.decodes):
            a = accepted[b]
            emitted = spec_tokens[b][:a + 1]
            first = n_plain + b * q_len
            results.append(RowResult(req, emitted,
                                     self._logprobs(logprobs, req, range(first, first + a + 1), emitted), a,
                                     counted[b]))
            if counted[b]:
                self.drafted += counted[b]
                self.accepted += a
                self.verify_rows += 1
        if new_drafts is not None:
            drafting = [req for req, n in step.extends if req.num_computed + n == len(req.token_ids)] + step.decodes
            for req, row in zip(drafting, new_drafts.tolist()):
                req.draft_token_ids = row
        return results

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

    def _model_draft(self, step: ScheduledStep, batch: ForwardBatch, hidden: torch.Tensor,
                     plain_tokens: torch.Tensor, spec) -> torch.Tensor:
        """k drafts per drafting row ([completing prefill rows ‖ verify rows], [D, k])."""
        runner, k, q_len = self.runner, self.k, self.q_len
        device = runner.device
        drafter = self.model_drafter
        # Tokens shifted by one: position i is fed the token at i + 1.
        shifted: list[int] = []
        fill_at: list[int] = []  # positions whose next token is this step's sampled token
        src_rows: list[int] = []
        src_tokens: list[int] = []
        drafting: list[Request] = []
        for row, (req, n) in enumerate(step.extends):
            start, end = req.num_computed, req.num_computed + n
            shifted.extend(req.token_ids[start + 1:end + 1])
            if end == len(req.token_ids):
                fill_at.append(len(shifted))
                shifted.append(0)
                src_rows.append(row)
                src_tokens.append(len(shifted) - 1)
                drafting.append(req)
        te = len(shifted)
        ids = torch.empty(batch.num_tokens, dtype=torch.long, device=device)
        ids[:te] = torch.tensor(shifted, dtype=torch.long, device=device)
        if fill_at:
            ids[torch.tensor(fill_at, device=device)] = plain_tokens
        ids[te:] = spec.tokens.flatten()  # padded speculation: all 1 + k positions of each verify row
        rows = len(step.decodes)
        src = torch.cat([torch.tensor(src_tokens, dtype=torch.long, device=device),
                         te + torch.arange(rows, device=device) * q_len + spec.num_accepted])  # [D]
        src_row = torch.cat([torch.tensor(src_rows, dtype=torch.long, device=device),
                             batch.num_extends + torch.arange(rows, device=device)])
        drafting += step.decodes
        h = drafter.first_pass(batch, ids, hidden)[src]  # [D, H_draft]; the pass also fills the drafter's KV
        if not drafting:  # only partial prefill chunks: nothing to draft yet
            return torch.zeros(0, k, dtype=torch.long, device=device)
        positions = batch.positions[src]  # [D]
        prompt_lens = torch.tensor([len(r.prompt_token_ids) for r in drafting], dtype=torch.long, device=device)
        base = SamplingTensors.build([_without_penalties(r.params) for r in drafting], [r.seed for r in drafting],
                                     [0] * len(drafting), [[]] * len(drafting), [[]] * len(drafting), device)
        page_table = batch.page_table[src_row]  # [D, P]
        drafts, qs = [], []
        for s in range(1, k + 1):
            if s > 1:
                positions = positions + 1
                h = drafter.step(_decode_batch(positions, page_table, batch.page_size, drafts[-1]), drafts[-1], h)
            # The draft of step s is the token at position + 2; its counter is its output index.
            t = replace(base, counters=positions + 2 - prompt_lens)
            q = processed_probs(drafter.logits(h), t)  # [D, V]
            draft = q.argmax(dim=-1) if t.all_greedy else torch.where(
                t.temperature == 0, q.argmax(dim=-1), sample_from_probs(q, t.seeds, t.counters, DRAFT_SALT))
            drafts.append(draft)
            qs.append(q)
        if not base.all_greedy:
            q_all = torch.stack(qs, dim=1)  # [D, k, V]
            for i, req in enumerate(drafting):
                if not req.params.greedy:
                    self.draft_probs[req.request_id] = q_all[i]
        return torch.stack(drafts, dim=1)  # [D, k]

    def _logprobs(self, logprobs: torch.Tensor | None, req: Request, rows, tokens: list[int]
                  ) -> list[TokenLogprob] | None:
        n = req.params.logprobs
        if n is None or logprobs is None:
            return None
        index = torch.tensor(list(rows), device=logprobs.device)
        chosen = logprobs[index].gather(1, torch.tensor(tokens, device=logprobs.device)[:, None]).squeeze(1)
        top_vals, top_ids = logprobs[index].topk(max(n, 1), dim=-1)
        return [TokenLogprob(tok, lp, list(zip(ids[:n], vals[:n])))
                for tok, lp, ids, vals in zip(tokens, chosen.tolist(), top_ids.tolist(), top_vals.tolist())]

    def stats(self) -> dict:
        return {
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "spec_mean_accepted_length": 1 + self.accepted / self.verify_rows if self.verify_rows else 0.0,
        }


def _without_penalties(params):
    return replace(params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)


def _decode_batch(positions: torch.Tensor, page_table: torch.Tensor, page_size: int,
                  input_ids: torch.Tensor) -> ForwardBatch:
    """A decode-only q_len-1 step built on device (no host reads): one token per row at
    ``positions``, its cache slot looked up in the row's pages."""
    rows = positions.shape[0]
    seq_lens = (positions + 1).to(torch.int32)
    pages = page_table.gather(1, (positions // page_size)[:, None]).squeeze(1).long()
    return ForwardBatch(
        num_extends=0, q_len_per_req=1, bs=rows, num_tokens=rows, page_size=page_size,
        input_ids=input_ids, positions=positions, slot_mapping=pages * page_size + positions % page_size,
        seq_lens=seq_lens, prefix_lens=seq_lens - 1,
        qo_indptr=torch.arange(rows + 1, dtype=torch.int32, device=positions.device),
        page_table=page_table, gather_ids=torch.arange(rows, device=positions.device),
        seq_lens_cpu=[], prefix_lens_cpu=[],
    )
