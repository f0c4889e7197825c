"""Pages of the latent KV cache: a reference-counted page pool with a prefix cache, and the
per-request page tables.

Page 0 is never handed out: padded rows of a captured graph point at it, so whatever they write
lands there and is never read by a real request.

Prefix caching. A full page whose KV a request has computed is registered under its content: the
node of the page before it (0 for a row's first page) and its tokens. A new request looks up its
prompt page by page along that chain and takes the pages it finds instead of computing them; its
first step is then a prefill row with a cached prefix, as a prompt's later chunk is. A page's key
also holds the token after the page when a model drafter runs (``key_next_token``): the drafter's KV
at a position is computed from the next token (MTP and EAGLE-3 feed the tokens shifted by one), so
the page's last slot is only right for a request that continues with the same token. Keys are the
tokens themselves, not a hash of them, so two different prefixes never share a page.

Registered pages are never written again: a request writes only at positions it has not computed,
and it shares only pages entirely below those (a request always computes at least its last prompt
token, whose logits it samples from). A page whose last reference goes is kept, idle, with its KV
and its key; idle pages are handed out (and dropped from the index) least recently released first,
after the free pages, so the cache only ever uses memory nothing else asks for. A request's pages
are released last page first: a chain's deeper pages go before the pages other prompts share.
"""

from __future__ import annotations

import itertools
import math
import mmap

import torch

DUMMY_PAGE = 0
ROOT = 0  # the node before a row's first page

PageKey = tuple[int, tuple[int, ...]]  # (node of the page before, the page's tokens [+ the next token])


class PagePool:
    """Reference-counted pages ``1 .. num_pages - 1``. A page at refcount 0 goes back to the free
    list, or, if it is registered in the prefix index, stays there idle until it is handed out again."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the reserved dummy page), got {num_pages}")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.free_pages = list(range(num_pages - 1, DUMMY_PAGE, -1))  # pop() hands out low ids first
        self.idle: dict[int, None] = {}  # registered pages at refcount 0, least recently released first
        self.index: dict[PageKey, int] = {}  # registered page by key
        # registered page -> (its key, its node id: what the keys of the pages after it hold)
        self.registered: dict[int, tuple[PageKey, int]] = {}
        self._node_ids = itertools.count(ROOT + 1)

    @property
    def num_free(self) -> int:
        """Pages ``alloc`` can hand out: free, or idle in the prefix cache."""
        return len(self.free_pages) + len(self.idle)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_cached(self) -> int:
        """Registered pages, in use or idle."""
        return len(self.registered)

    def alloc(self, n: int) -> list[int] | None:
        """n pages with refcount 1 and no key (free pages first, then the least recently released
        idle ones, dropped from the index), or None (and nothing taken) if fewer are free."""
        if n > self.num_free:
            return None
        pages = [self.free_pages.pop() for _ in range(min(n, len(self.free_pages)))]
        while len(pages) < n:
            page = next(iter(self.idle))
            del self.idle[page]
            self._unregister(page)
            pages.append(page)
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"incref of page {p}, which is not allocated")
            self.refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"release of page {p}, which is not allocated")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                if p in self.registered:
                    self.idle[p] = None
                else:
                    self.free_pages.append(p)

    def register(self, page: int, key: PageKey) -> int:
        """Registers an allocated page under ``key``; returns the node id of the page the index holds
        for ``key`` (this one, or an earlier one with the same content, which stays)."""
        if self.refcount[page] <= 0:
            raise RuntimeError(f"register of page {page}, which is not allocated")
        held = self.index.get(key)
        if held is not None:
            return self.registered[held][1]
        if page in self.registered:
            raise RuntimeError(f"page {page} is registered already, under another key")
        node = next(self._node_ids)
        self.index[key] = page
        self.registered[page] = (key, node)
        return node

    def take(self, key: PageKey) -> tuple[int, int] | None:
        """(page, node id) registered under ``key``, with a reference taken for the caller; None if none."""
        page = self.index.get(key)
        if page is None:
            return None
        if self.refcount[page] == 0:
            del self.idle[page]
        self.refcount[page] += 1
        return page, self.registered[page][1]

    def _unregister(self, page: int) -> None:
        key, _ = self.registered.pop(page)
        del self.index[key]


class KVCacheManager:
    """Which pages each request owns. Capacity is reserved for every token a step may write
    (a decode row with k draft tokens needs seq_len + 1 + k), all or nothing. With
    ``prefix_caching`` a request's full computed pages are registered as it goes (``cache_pages``)
    and new requests start from them (``match_prefix``); see the module docstring."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False,
                 key_next_token: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.tables: dict[str, list[int]] = {}
        self.prefix_caching = prefix_caching
        self._extra = 1 if key_next_token else 0  # tokens past a page its key holds
        # request id -> (the computed length at which its next page is full, the node of its last
        # registered page); a request with none is at (page_size, ROOT). A step checks the first.
        self.chains: dict[str, tuple[int, int]] = {}

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extra_pages_needed(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(self.tables.get(request_id, ())))

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Makes the request own exactly enough pages for ``num_tokens`` cache slots (it never
        shrinks here). False, with nothing allocated, if the pool is short."""
        table = self.tables.setdefault(request_id, [])
        need = self.pages_for(num_tokens) - len(table)
        if need <= 0:
            return True
        pages = self.pool.alloc(need)
        if pages is None:
            if not table:
                del self.tables[request_id]
            return False
        table.extend(pages)
        return True

    def match_prefix(self, request_id: str, token_ids: list[int]) -> int:
        """Gives a request that owns no pages yet the cached pages that hold the start of ``token_ids``;
        returns how many tokens they hold (whole pages, always fewer than ``token_ids``)."""
        if not self.prefix_caching or request_id in self.tables:
            return 0
        ps, table, node = self.page_size, [], ROOT
        while (len(table) + 1) * ps < len(token_ids):  # a page, and the token after it, in the prompt
            found = self.pool.take((node, self.page_key(token_ids, len(table))))
            if found is None:
                break
            page, node = found
            table.append(page)
        if table:
            self.tables[request_id] = table
            self.chains[request_id] = ((len(table) + 1) * ps, node)
        return len(table) * ps

    def page_key(self, token_ids: list[int], index: int) -> tuple[int, ...] | None:
        """The tokens of page ``index`` of ``token_ids`` as its key holds them (with the next token
        when a model drafter runs); None where ``token_ids`` do not reach that far."""
        start = index * self.page_size
        end = start + self.page_size + self._extra
        return tuple(token_ids[start:end]) if len(token_ids) >= end else None

    def cache_pages(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Registers the request's pages that are full of computed KV (``num_computed`` tokens of
        ``token_ids``, the tokens committed so far) and not registered yet."""
        if not self.prefix_caching:
            return
        ps = self.page_size
        full = min(num_computed, len(token_ids) - self._extra) // ps
        due, node = self.chains.get(request_id, (ps, ROOT))
        if full < due // ps:
            return
        table = self.tables[request_id]
        for i in range(due // ps - 1, full):
            node = self.pool.register(table[i], (node, self.page_key(token_ids, i)))
        self.chains[request_id] = ((full + 1) * ps, node)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Releases the request's pages beyond those that hold ``num_tokens`` tokens."""
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = self.pages_for(num_tokens)
        if len(table) > keep:
            self.pool.release(table[keep:][::-1])
            del table[keep:]

    def free(self, request_id: str) -> None:
        """Releases all the request's pages, the last first (module docstring)."""
        self.chains.pop(request_id, None)
        table = self.tables.pop(request_id, None)
        if table:
            self.pool.release(table[::-1])

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_total_pages(self) -> int:
        return self.pool.num_usable

    @property
    def num_cached_pages(self) -> int:
        return self.pool.num_cached


def allocate_kv_caches(num_layers: int, num_pages: int, page_size: int, latent_dim: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One [num_pages, page_size, latent_dim] latent cache per layer."""
    return [zeroed_pool((num_pages, page_size, latent_dim), dtype, device) for _ in range(num_layers)]


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A KV pool, zeroed: a slot never written may still be read under a mask, and must not hold a NaN.
    On the CPU it is anonymous memory, which the OS zeroes a page at a time as it is first written:
    zero-filling the embedded model's 1.28 GB pool took 0.5-1.35 s of a start (the CI machine), and its
    memory was taken whether the pool was used or not."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)  # the tensor holds a reference to it
    return torch.frombuffer(memory, dtype=dtype).view(shape)
