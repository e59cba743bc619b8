"""Shared affix pages: the affix cache (:mod:`acache.affix.cache`) over the engine's page pool. Each affix's
K/V is written once into pool pages, never by a request; a request that cannot get its pages waits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from acache.affix.cache import AffixCache
from acache.affix.entry import AffixEntry
from acache.engine.page_pool import PagePool
from acache.models.base import DiffusionLM


@dataclass
class SharedAffix:
    key: str
    token_ids: tuple[int, ...]
    pages: list[int]
    slots: torch.Tensor  # [n] physical slots of the affix's tokens
    refcount: int = 0
    name: str | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def entry(self, pool: PagePool) -> AffixEntry:
        """The affix's K/V read back from its pages (for selection, which works on a canvas copy)."""
        return AffixEntry(self.key, self.token_ids, [k[self.slots] for k in pool.keys],
                          [v[self.slots] for v in pool.values], name=self.name)


class PagedStorage:
    """K/V in pages of the pool; room is free pages, and at most ``max_pages`` of them for affixes (None:
    any), so that a bounded share of the pool holds shared affixes whatever the traffic."""

    def __init__(self, pool: PagePool, max_pages: int | None = None) -> None:
        self.pool = pool
        self.max_pages = max_pages
        self.used = 0

    def cost(self, num_tokens: int) -> int:
        return self.pool.pages_for(num_tokens)

    def has_room(self, cost: int) -> bool:
        capped = self.max_pages is not None and self.used + cost > self.max_pages
        return not capped and self.pool.num_free >= cost

    @property
    def capacity(self) -> int:
        return self.pool.num_pages if self.max_pages is None else min(self.max_pages, self.pool.num_pages)

    def put(self, entry: AffixEntry) -> SharedAffix:
        pages = self.pool.allocate(self.pool.pages_for(entry.length))
        if pages is None:
            raise RuntimeError(f"no pool pages for affix {entry.key[:12]}; make room first")
        slots = self.pool.slots(pages, entry.length)
        try:
            self.pool.write(slots, entry.keys, entry.values)
        except Exception:
            self.pool.free(pages)
            raise
        self.used += len(pages)
        return SharedAffix(entry.key, entry.token_ids, pages, slots, name=entry.name)

    def read(self, handle: SharedAffix) -> AffixEntry:
        return handle.entry(self.pool)

    def drop(self, handle: SharedAffix) -> None:
        self.pool.free(handle.pages)
        self.used -= len(handle.pages)


class AffixPageTable(AffixCache[SharedAffix]):
    """``max_tokens`` bounds the tokens the shared affixes may hold, rounded up to whole pages (None: the
    pool); an affix longer than that is computed with its request instead of shared."""

    def __init__(self, model: DiffusionLM, pool: PagePool, max_tokens: int | None = None) -> None:
        max_pages = None if max_tokens is None else pool.pages_for(max_tokens)
        super().__init__(model, PagedStorage(pool, max_pages), wait_when_full=True)
        self.pool = pool

    def evict_until(self, cost: int, keep: set[str] = frozenset()) -> bool:
        """As the base rule, but evicts nothing when evicting every affix no request holds (nor ``keep``) would
        still leave no room for ``cost`` pages, under the cap or in the pool: an affix is never evicted in vain."""
        pinned = sum(len(e.pages) for k, e in self.entries.items() if e.refcount > 0 or k in keep)
        if not self.fits_pages(pinned + cost) or self.pool.num_free + self.reclaimable_pages(keep) < cost:
            return False
        return super().evict_until(cost, keep)

    def free_pool_pages(self, pages: int, keep: set[str] = frozenset()) -> bool:
        """Evicts affixes no request holds (``keep`` aside), least recently used first, until the pool has
        ``pages`` free; evicts nothing when evicting all of them could not reach it."""
        if self.pool.num_free + self.reclaimable_pages(keep) < pages:
            return False
        return self.evict_while(lambda: self.pool.num_free < pages, keep)

    def fits_pages(self, pages: int) -> bool:
        """Affixes of ``pages`` pages in all can be shared at once under the cap."""
        cap = self.storage.max_pages
        return cap is None or pages <= cap

    def fits(self, num_tokens: int) -> bool:
        """An affix of ``num_tokens`` can be shared at all under the cap."""
        return self.fits_pages(self.pool.pages_for(num_tokens))

    @property
    def pages_in_use(self) -> int:
        return sum(len(e.pages) for e in self.entries.values())

    def reclaimable_pages(self, keep: set[str] = frozenset()) -> int:
        """Pages that evicting every affix no request holds, ``keep`` aside, would give back."""
        return sum(len(e.pages) for k, e in self.entries.items() if e.refcount == 0 and k not in keep)
