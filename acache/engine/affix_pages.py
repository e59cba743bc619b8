"""Shared affix pages: each affix's K/V written once into pool pages, found by content hash, refcounted
by the requests that hold it, and evicted least-recently-used only when no request does."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from acache.affix.prompt import affix_key
from acache.affix.store import AffixEntry, AffixStore, compute_affix
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


class AffixPageTable:
    def __init__(self, model: DiffusionLM, pool: PagePool, source: AffixStore | None = None) -> None:
        self.model = model
        self.pool = pool
        self.source = source
        self.entries: OrderedDict[str, SharedAffix] = OrderedDict()
        self.hits = 0
        self.queries = 0
        self.evictions = 0

    @property
    def pages_in_use(self) -> int:
        return sum(len(e.pages) for e in self.entries.values())

    def lookup(self, token_ids: tuple[int, ...]) -> SharedAffix | None:
        entry = self.entries.get(affix_key(token_ids))
        return entry if entry is not None and entry.token_ids == token_ids else None

    def reclaimable_pages(self) -> int:
        return sum(len(e.pages) for e in self.entries.values() if e.refcount == 0)

    def evict_until(self, free_pages: int, keep: set[str] = frozenset()) -> bool:
        """Evicts unreferenced affixes, oldest first, until the pool has ``free_pages`` free pages."""
        for key in [k for k, e in self.entries.items() if e.refcount == 0 and k not in keep]:
            if self.pool.num_free >= free_pages:
                break
            self.pool.free(self.entries.pop(key).pages)
            self.evictions += 1
        return self.pool.num_free >= free_pages

    def collides(self, token_ids: tuple[int, ...]) -> bool:
        """Another affix holds this content hash: this one cannot be shared and is computed privately."""
        entry = self.entries.get(affix_key(token_ids))
        return entry is not None and entry.token_ids != token_ids

    def acquire(self, token_ids: tuple[int, ...], name: str | None = None) -> tuple[SharedAffix, bool] | None:
        """``(shared affix, hit)``, computed and written on a miss; None when its pages cannot be had now.

        On a miss the K/V come from ``source`` (a persistent :class:`AffixStore`) when it holds the affix.
        """
        self.queries += 1
        key = affix_key(token_ids)
        entry = self.entries.get(key)
        if entry is not None:
            if entry.token_ids != token_ids:
                raise ValueError(f"affix hash {key[:12]} collides with another affix; check collides() first")
            self.hits += 1
            self.entries.move_to_end(key)
            entry.refcount += 1
            return entry, True
        need = self.pool.pages_for(len(token_ids))
        if not self.evict_until(need):
            self.queries -= 1  # not answered yet: the request waits and asks again
            return None
        stored = self.source.entries.get(key) if self.source is not None else None
        hit = stored is not None and stored.token_ids == token_ids
        computed = stored if hit else compute_affix(self.model, token_ids, name)
        if hit:
            self.hits += 1
        pages = self.pool.allocate(need)
        slots = self.pool.slots(pages, len(token_ids))
        self.pool.write(slots, computed.keys, computed.values)
        entry = SharedAffix(key, token_ids, pages, slots, refcount=1, name=name)
        self.entries[key] = entry
        return entry, hit

    def release(self, entry: SharedAffix) -> None:
        if entry.refcount <= 0:
            raise RuntimeError(f"shared affix {entry.key[:12]} released more often than acquired")
        entry.refcount -= 1
