"""Pages of the latent KV cache: a reference-counted page pool and the per-request page tables.

Page 0 is never handed out: padded rows of a captured graph point at it, so whatever they write
lands there and is never read by a real request.
"""

from __future__ import annotations

import torch

DUMMY_PAGE = 0


class PagePool:
    """Reference-counted pages ``1 .. num_pages - 1``; a page returns to the free list at refcount 0."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the reserved dummy page), got {num_pages}")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.free_pages = list(range(num_pages - 1, DUMMY_PAGE, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages with refcount 1, or None (and nothing taken) if fewer are free."""
        if n > len(self.free_pages):
            return None
        pages = [self.free_pages.pop() for _ in range(n)]
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
                self.free_pages.append(p)


class KVCacheManager:
    """Which pages each request owns. Capacity is reserved for every token a step may write
    (a decode row with k draft tokens needs seq_len + 1 + k), all or nothing."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.tables: dict[str, list[int]] = {}

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

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Releases the request's pages beyond those that hold ``num_tokens`` tokens."""
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = self.pages_for(num_tokens)
        if len(table) > keep:
            self.pool.release(table[keep:])
            del table[keep:]

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table:
            self.pool.release(table)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_total_pages(self) -> int:
        return self.pool.num_usable


def allocate_kv_caches(num_layers: int, num_pages: int, page_size: int, latent_dim: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One [num_pages, page_size, latent_dim] latent cache per layer."""
    return [torch.zeros(num_pages, page_size, latent_dim, dtype=dtype, device=device) for _ in range(num_layers)]
