"""Shared affix pages: the affix cache (:mod:`acache.affix.cache`) over the engine's page pool. Each affix's
K/V is written once into pool pages, never by a request; a request that cannot get its pages waits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from acache.affix.cache import AffixCache, AffixEntry
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
    """K/V in pages of the pool; room is free pages."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool

    def cost(self, num_tokens: int) -> int:
        return self.pool.pages_for(num_tokens)

    def has_room(self, cost: int) -> bool:
        return self.pool.num_free >= cost

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
        return SharedAffix(entry.key, entry.token_ids, pages, slots, name=entry.name)

    def read(self, handle: SharedAffix) -> AffixEntry:
        return handle.entry(self.pool)

    def drop(self, handle: SharedAffix) -> None:
        self.pool.free(handle.pages)


class AffixPageTable(AffixCache[SharedAffix]):
    def __init__(self, model: DiffusionLM, pool: PagePool) -> None:
        super().__init__(model, PagedStorage(pool), wait_when_full=True)
        self.pool = pool

    @property
    def pages_in_use(self) -> int:
        return sum(len(e.pages) for e in self.entries.values())

    def reclaimable_pages(self) -> int:
        return sum(len(e.pages) for e in self.entries.values() if e.refcount == 0)
