"""Picks the rows of each step under a token budget: decode rows first, then prefill chunks."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from encore.engine.kv_cache import ROOT, KVCacheManager
from encore.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledStep:
    """Rows of one step in step-layout order: ``extends`` (request, new tokens) first, then
    ``decodes``, each feeding ``q_len_per_req`` tokens."""

    extends: list[tuple[Request, int]] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    q_len_per_req: int = 1
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.extends and not self.decodes


class Scheduler:
    """FCFS with chunked prefill and preemption by recompute.

    A request admitted from the queue starts from the pages the prefix cache holds for its tokens
    (``KVCacheManager.match_prefix``): its first chunk begins past them. One whose next page another
    request is computing (the same leading tokens, that request still in its prompt) waits in the
    queue, without holding back those behind it, until that page is cached: a burst of prompts behind
    one uncached system prompt computes it once (SGLang calls this in-batch prefix caching).

    Running decode rows claim the budget first; a decode row whose pages cannot be reserved
    preempts the most recently admitted running request (its pages are freed and it goes back to
    the front of the queue to recompute), or itself if it is the last one. The rest of the budget
    goes to prefill chunks: unfinished prompts first, then waiting requests in arrival order
    (a waiting request that cannot get pages blocks those behind it, so none is starved).
    With ``mixed`` off a step is either all prefill or all decode (prefill first).

    While a step is in flight (overlapped steps, engine.py) a request's last token may not be known yet:
    its decode row feeds it from the device; one whose last token ends it by length
    (``Request.final_pending``) gets no row, and a preempted one waits until the token is known.
    """

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, chunked_prefill_size: int,
                 max_num_seqs: int, mixed: bool) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.max_num_seqs = max_num_seqs
        self.mixed = mixed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lookahead = 0
        self.prefix_query_tokens = 0  # tokens of admitted requests (prompt, and output after a preemption)
        self.prefix_hit_tokens = 0  # of which the prefix cache held
        self.prefix_deferrals = 0  # admissions put off a step to take a page another request is computing

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drops a request (finished or aborted) from the queues and frees its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def cache_pages(self, step: ScheduledStep) -> None:
        """Registers the newly filled pages of a step's rows in the prefix cache (after the step). Most
        steps fill none: a row is looked at only once its computed length reaches its next page's end."""
        kv = self.kv
        if not kv.prefix_caching:
            return
        chains, root = kv.chains, (kv.page_size, ROOT)
        for req in itertools.chain((req for req, _ in step.extends), step.decodes):
            if req.num_computed >= chains.get(req.request_id, root)[0] and not req.finished:
                kv.cache_pages(req.request_id, req.token_ids, req.num_computed_known)

    def _release(self, req: Request) -> None:
        """Frees the request's pages, registering first those it filled (they outlive it, idle): those
        of known tokens only, not of a token the step in flight has yet to give."""
        self.kv.cache_pages(req.request_id, req.token_ids, req.num_computed_known)
        self.kv.free(req.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, q_len_per_req: int = 1, lookahead: int = 0) -> ScheduledStep:
        """``lookahead``: cache slots a model drafter writes past the tokens a row feeds (draft
        steps 2..k), reserved with them for decode rows and for prefill rows that complete."""
        step = ScheduledStep(q_len_per_req=q_len_per_req)
        self.lookahead = lookahead
        while True:
            if self.mixed:
                self._schedule_prefills(step, self._schedule_decodes(step, self.max_num_batched_tokens))
            else:
                self._schedule_prefills(step, self.max_num_batched_tokens)
                if step.empty:
                    self._schedule_decodes(step, self.max_num_batched_tokens)
            if not step.empty or all(req.final_pending for req in self.running):
                return step  # (rows whose last token is in flight end when it is read: nothing to preempt)
            # Partial prefills hold every page and none can grow: recompute the newest later.
            self._preempt(self.running[-1], step)

    def _schedule_decodes(self, step: ScheduledStep, budget: int) -> int:
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if not req.is_decoding or req.final_pending:
                i += 1
                continue
            if budget < step.q_len_per_req:
                break
            while not self.kv.reserve(req.request_id, req.num_computed + step.q_len_per_req + self.lookahead):
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself: nothing after it can get pages either
            step.decodes.append(req)
            budget -= step.q_len_per_req
            i += 1
        return budget

    def _schedule_prefills(self, step: ScheduledStep, budget: int) -> None:
        scheduled = set(id(r) for r in step.decodes)
        for req in self.running:
            if budget <= 0:
                return
            if req.is_decoding or id(req) in scheduled:
                continue
            n = min(req.num_uncomputed, self.chunked_prefill_size, budget)
            if self.kv.reserve(req.request_id, self._prefill_slots(req, n)):
                step.extends.append((req, n))
                budget -= n
        leaders = None  # built for the first queued request that gets this far: most steps have none
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if not req.ready:
                continue  # a grammar still compiling holds back only its own request
            if leaders is None and self.kv.prefix_caching:
                leaders = PrefillLeaders(self.kv, self.running)
            cached = self.kv.match_prefix(req.request_id, req.token_ids)
            if leaders is not None and leaders.computing_next_page(req.token_ids, cached):
                self.kv.free(req.request_id)  # its cached pages: a waiting request holds none
                self.prefix_deferrals += 1
                continue
            req.num_computed = cached
            n = min(req.num_uncomputed, self.chunked_prefill_size, budget)
            if not self.kv.reserve(req.request_id, self._prefill_slots(req, n)):
                self.kv.free(req.request_id)  # the cached pages too: a waiting request holds none
                req.num_computed = 0
                return
            self.prefix_query_tokens += len(req.token_ids)
            self.prefix_hit_tokens += cached
            if not req.num_preemptions:
                req.num_cached_tokens = cached
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            step.extends.append((req, n))
            budget -= n
            if leaders is not None:
                leaders.add(req)

    def _prefill_slots(self, req: Request, n: int) -> int:
        completes = n == req.num_uncomputed
        return req.num_computed + n + (self.lookahead if completes else 0)

    def _preempt(self, req: Request, step: ScheduledStep) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        step.preempted.append(req)


class PrefillLeaders:
    """The running requests still computing their prompt, found by the page a queued request needs
    next: a request that would start after ``cached`` tokens waits when one of them will fill its next
    page (the same tokens before it and in it), to take that page from the prefix cache instead of
    computing it again. Looked up by (page index, the page's tokens), an index built per page index on
    first use, so a step's check costs a dict lookup per queued request, whatever the queue's length;
    only a candidate found there has its whole prefix compared."""

    def __init__(self, kv: KVCacheManager, running: list[Request]) -> None:
        self.kv = kv
        self.leaders = [req for req in running if not req.is_decoding]
        self.by_page: dict[int, dict[tuple[int, ...], list[Request]]] = {}  # page index -> page key -> leaders

    def add(self, req: Request) -> None:
        """A request admitted in this step: it computes its prompt from now on."""
        self.leaders.append(req)
        for index, leaders in self.by_page.items():
            self._file(leaders, req, index)

    def computing_next_page(self, token_ids: list[int], cached: int) -> bool:
        if cached + self.kv.page_size >= len(token_ids):
            return False  # no page past the cache to take: the last prompt token is always computed
        index = cached // self.kv.page_size
        key = self.kv.page_key(token_ids, index)
        leaders = self.by_page.get(index)
        if leaders is None:
            leaders = self.by_page[index] = {}
            for leader in self.leaders:
                self._file(leaders, leader, index)
        return any(leader.token_ids[:cached] == token_ids[:cached] for leader in leaders.get(key, ()))

    def _file(self, leaders: dict[tuple[int, ...], list[Request]], req: Request, index: int) -> None:
        key = self.kv.page_key(req.token_ids, index)
        if key is not None:
            leaders.setdefault(key, []).append(req)

