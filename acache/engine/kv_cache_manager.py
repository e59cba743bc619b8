"""The KV-cache manager: the page pool, each request's private pages and the shared affixes.

A request's canvas has a fixed size, so every page it will ever need (its private slots and its
shared affixes) is taken at admission, all or nothing; a request that does not fit waits. Shared
affix pages are written once and never by a request. BiCache requests splice in the affix's
per-layer hidden states too, which live in the dense affix store; they own a private copy of the
affix K/V, since their deep layers recompute it.
"""

from __future__ import annotations

import torch

from acache.affix.store import AffixStore
from acache.decoding.request_state import StepPlan
from acache.engine.affix_pages import AffixPageTable
from acache.engine.page_pool import PagePool
from acache.engine.request import Request
from acache.models.base import DiffusionLM


class KVCacheManager:
    def __init__(self, model: DiffusionLM, pool: PagePool, store: AffixStore | None = None,
                 max_affix_tokens: int | None = None) -> None:
        self.pool = pool
        # dense, for BiCache's hidden states: bounded, the hidden states counted in each entry's cost
        self.store = store if store is not None else AffixStore(model, 1 << 30, keep_hidden=True)
        self.affixes = AffixPageTable(model, pool, max_affix_tokens)

    def shareable(self, req: Request) -> list[int]:
        """The request's affixes that take shared pages, in order while their pages together fit the affix cap
        (the others are computed with it: a request must never wait for room only it holds); an affix that
        appears twice takes its pages once. None of them (an empty list) where sharing would need more pages
        than the whole pool (each part is rounded up to whole pages, and anchors take private pages beside the
        shared copy) while computing the affixes with the request would not."""
        chosen, pages, seen = [], 0, set()
        for i, span in enumerate(req.prompt.affixes):
            ids = req.prompt.affix_ids(span)
            if ids in seen:
                chosen.append(i)
                continue
            need = self.pool.pages_for(span.length)
            if self.affixes.fits_pages(pages + need):
                chosen.append(i)
                pages += need
                seen.add(ids)
        if chosen and pages + self.pool.pages_for(req.private_tokens(chosen)) > self.pool.num_pages:
            return []
        return chosen

    def _shared_pages(self, req: Request, indices: list[int]) -> int:
        spans = {req.prompt.affix_ids(req.prompt.affixes[i]) for i in indices}
        return sum(self.pool.pages_for(len(ids)) for ids in spans)

    def pages_needed_alone(self, req: Request) -> int:
        """Pages the request needs in an empty pool: its private pages plus its shared affixes' pages."""
        if req.bicache or not req.reuse:
            return self.pool.pages_for(req.length)
        indices = self.shareable(req)
        return self._shared_pages(req, indices) + self.pool.pages_for(req.private_tokens(indices))

    def check(self, req: Request) -> None:
        """Raises a ValueError when the request needs more pages than the whole pool."""
        need, pool = self.pages_needed_alone(req), self.pool
        if need > pool.num_pages:
            raise ValueError(f"{req.label} needs {need} KV pages of {pool.page_size} tokens, "
                             f"more than the whole pool of {pool.num_pages}; raise kv_cache_memory")

    @staticmethod
    def step_cost(req: Request, plan: StepPlan) -> int:
        """Tokens the request's next forward runs: the ones it feeds."""
        return len(plan.fed)

    def memory_usage(self) -> tuple[int, int, int]:
        """``(peak pages, pages in use, bytes a page)``."""
        return self.pool.peak_pages_used, self.pool.num_used, self.pool.page_bytes

    @property
    def capacity_bytes(self) -> int:
        """What the pool holds, in bytes (``/metrics``: the same for every cache manager)."""
        return self.pool.num_pages * self.pool.page_bytes

    def reset_peak(self) -> None:
        self.pool.peak_pages_used = self.pool.num_used

    def allocate(self, req: Request) -> bool:
        """Takes the request's shared affixes and private pages, all or nothing (also when computing an
        affix raises: what it took so far goes back through :meth:`free`); fills its slot map for every
        column but the shared ones (set once its anchors are known). False when they cannot be had now."""
        stats = self.affixes.stats
        hits, misses = stats.hits, stats.misses
        looked: list[tuple[str, bool]] = []
        error = None
        try:
            admitted = self._allocate(req, looked)
        except BaseException as exc:
            admitted, error = False, exc
        # each lookup counts once, at the try that admits the request (not as acquire counted it); a hit on an
        # affix an earlier try of it computed (kept, and found now) is this request's miss, a failed try's too
        stats.hits, stats.misses = hits, misses
        if not admitted:
            self.free(req)
            req.computed |= {key for key, hit in looked if not hit}
            if error is not None:
                raise error
            return False
        found = sum(hit and key not in req.computed for key, hit in looked)
        stats.hits, stats.misses = hits + found, misses + len(looked) - found
        req.stats.affix_hits += found
        return True

    def _allocate(self, req: Request, looked: list[tuple[str, bool]]) -> bool:
        """Acquires into ``req`` as it goes, so that :meth:`free` can undo a partial admission; each shared
        affix looked up goes into ``looked`` as ``(key, hit)``."""
        req.stats.affix_hits = 0  # a request that waited counts only the try that admits it
        if req.reuse and not req.bicache:
            # another affix holding an affix's hash: that one is computed privately instead
            indices = [i for i in self.shareable(req) if not self.affixes.collides(req.prompt.affix_ids(
                req.prompt.affixes[i]))]
            if not self._fits_now(req, indices):  # before any affix is computed or another evicted for it
                return False
            # the cached ones first: held, no affix of this request's own is evicted to make room for another
            cached_first = sorted(indices, key=lambda i: self.affixes.lookup(
                req.prompt.affix_ids(req.prompt.affixes[i])) is None)
            for index in cached_first:
                span = req.prompt.affixes[index]
                ids = req.prompt.affix_ids(span)
                got = self.affixes.acquire(ids, span.name)
                if got is None:
                    return False
                req.shared.append((index, got[0]))
                looked.append((got[0].key, got[1]))  # counted by allocate, once it admits the request
            req.shared.sort(key=lambda pair: pair[0])  # in prompt order, as the spans are read
        need = self.pool.pages_for(req.private_tokens([i for i, _ in req.shared]))
        pages = self.pool.allocate(need)
        if pages is None and self.affixes.free_pool_pages(need, {a.key for _, a in req.shared}):
            pages = self.pool.allocate(need)
        if pages is None:
            return False
        req.private_pages = pages
        req.private_slots = self.pool.slots(pages, len(pages) * self.pool.page_size)
        req.stats.private_pages = len(pages)
        if req.bicache:
            for index, span in enumerate(req.prompt.affixes):
                entry, hit = self.store.acquire(req.prompt.affix_ids(span), span.name)
                req.entries.append((index, entry))
                self.store.ensure_hidden(entry)
                req.stats.affix_hits += hit
        req.stats.affix_queries = len(req.shared) + len(req.entries)
        if req.bicache or not req.reuse:
            req.slot_map = req.private_slots[:req.length].clone()
        return True

    def _fits_now(self, req: Request, indices: list[int]) -> bool:
        """Whether the whole admission (the affixes at ``indices`` not cached yet, then the private pages) can be
        had now from the free pages and those of idle affixes it does not use, under the affix cap: acquiring
        first and finding the private pages short would have evicted or computed affixes in vain."""
        table, pool = self.affixes, self.pool
        spans = {req.prompt.affix_ids(req.prompt.affixes[i]) for i in indices}
        cached = {table.key_fn(ids) for ids in spans if table.lookup(ids) is not None}
        new = sum(pool.pages_for(len(ids)) for ids in spans if table.key_fn(ids) not in cached)
        private = pool.pages_for(req.private_tokens(indices))
        pinned = sum(len(e.pages) for k, e in table.entries.items() if e.refcount > 0 or k in cached)
        return table.fits_pages(pinned + new) and pool.num_free + table.reclaimable_pages(cached) >= new + private

    def map_slots(self, req: Request) -> None:
        """Once the recompute set is fixed: recomputed columns to private slots, the rest to shared ones."""
        req.slot_map = self.slot_map(req, req.state.recompute)

    @staticmethod
    def slot_map(req: Request, recompute: torch.Tensor) -> torch.Tensor:
        """``[T]``: the physical slot of each column when ``recompute`` is its recompute set (the one rule, read
        also by a forward that chooses the anchors and writes their K/V before the scheduler fixes them)."""
        slot_map = torch.zeros(req.length, dtype=torch.long, device=req.private_slots.device)
        for index, affix in req.shared:
            c0, c1 = req.span_columns(index)
            slot_map[c0:c1] = affix.slots
        count = int(recompute.sum())
        if count > req.private_slots.numel():
            raise RuntimeError(f"request {req.request_id} recomputes {count} tokens but holds "
                               f"{req.private_slots.numel()} private slots")
        slot_map[recompute] = req.private_slots[:count]
        return slot_map

    def free(self, req: Request) -> None:
        self.pool.free(req.private_pages)
        req.private_pages = []
        for _, affix in req.shared:
            self.affixes.release(affix)
        req.shared = []
        for _, entry in req.entries:
            self.store.release(entry)
        req.entries = []
