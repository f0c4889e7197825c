"""Picks the rows of each step under a token budget: decode rows first, then prefill chunks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from encore.engine.kv_cache import KVCacheManager
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

    def cache_pages(self, reqs: list[Request]) -> None:
        """Registers the running requests' newly filled pages in the prefix cache (after a step). Most
        steps fill none: a row is looked at only once its computed length reaches its next page's end."""
        kv = self.kv
        if not kv.prefix_caching:
            return
        due, first = kv.next_full, kv.page_size
        for req in reqs:
            if req.num_computed >= due.get(req.request_id, first) and not req.finished:
                kv.cache_pages(req.request_id, req.token_ids, req.num_computed)

    def _release(self, req: Request) -> None:
        """Frees the request's pages, registering first those it filled (they outlive it, idle)."""
        self.kv.cache_pages(req.request_id, req.token_ids, req.num_computed)
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
            if not step.empty or not self.running:
                return step
            # Partial prefills hold every page and none can grow: recompute the newest later.
            self._preempt(self.running[-1], step)

    def _schedule_decodes(self, step: ScheduledStep, budget: int) -> int:
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if not req.is_decoding:
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
        leaders = self._prefill_leaders() if self.kv.prefix_caching else None
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if not req.ready:
                continue  # a grammar still compiling holds back only its own request
            cached = self.kv.match_prefix(req.request_id, req.token_ids)
            if leaders is not None and self._follows(req, cached, leaders):
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
                leaders.setdefault(self._first_page(req), []).append(req)

    def _prefill_leaders(self) -> dict[tuple[int, ...], list[Request]]:
        """Running requests still computing their prompt, by their first page's tokens."""
        leaders: dict[tuple[int, ...], list[Request]] = {}
        for req in self.running:
            if not req.is_decoding:
                leaders.setdefault(self._first_page(req), []).append(req)
        return leaders

    def _first_page(self, req: Request) -> tuple[int, ...]:
        return tuple(req.token_ids[:self.kv.page_size])

    def _follows(self, req: Request, cached: int, leaders: dict[tuple[int, ...], list[Request]]) -> bool:
        """Whether a request that would start after ``cached`` tokens shares its next page with a
        request computing it now: then it waits for that page to reach the prefix cache instead of
        computing it again (a burst of prompts behind one system prompt computes it once)."""
        return any(self.kv.next_page_shared(req.token_ids, cached, leader.token_ids)
                   for leader in leaders.get(self._first_page(req), ()))

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
