"""Continuous batching of diffusion requests: admission by free pages, and per-step batches of anchor
selections, refreshes and in-block steps under a token budget.

A request's canvas has a fixed size, so every page it will ever need (its private slots and its shared
affixes) is taken at admission, all or nothing. A request that does not fit waits, first come first
served, while running ones finish and unreferenced affixes are evicted; it never fails half-way and is
never preempted. One that could not fit even in an empty pool is refused when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from acache.engine.affix_pages import AffixPageTable, SharedAffix
from acache.engine.page_pool import PagePool
from acache.engine.sequence import Phase, Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass
class ScheduledBatch:
    select: list[Sequence]
    refresh: list[Sequence]
    step: list[Sequence]

    def __bool__(self) -> bool:
        return bool(self.select or self.refresh or self.step)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool, affixes: AffixPageTable) -> None:
        self.config = config
        self.pool = pool
        self.affixes = affixes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_needed_alone(self, seq: Sequence) -> int:
        """Pages the request needs in an empty pool: its private pages plus its affixes' pages."""
        lengths = [span.length for span in seq.prompt.affixes] if seq.reuse else []
        shared = sum(self.pool.pages_for(n) for n in lengths)
        return shared + self.pool.pages_for(seq.private_tokens(lengths))

    def add(self, seq: Sequence) -> None:
        need = self.pages_needed_alone(seq)
        if need > self.pool.num_pages:
            raise ValueError(f"request {seq.request_id} needs {need} KV pages of {self.pool.page_size} tokens, "
                             f"more than the whole pool of {self.pool.num_pages}; raise kv_cache_memory")
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status = Status.ABORTED
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq, Status.ABORTED)
                return seq
        return None

    def _acquire_affixes(self, seq: Sequence) -> list[tuple[int, SharedAffix, bool]] | None:
        """The request's shared affixes as ``(index, affix, hit)``, or None (holding nothing) when their
        pages cannot be had now. An affix whose hash another one holds is left to be computed privately."""
        held: list[tuple[int, SharedAffix, bool]] = []
        if not seq.reuse:
            return held
        for index, span in enumerate(seq.prompt.affixes):
            ids = seq.prompt.affix_ids(span)
            if self.affixes.collides(ids):
                continue
            got = self.affixes.acquire(ids, span.name)
            if got is None:
                for _, affix, _ in held:
                    self.affixes.release(affix)
                return None
            held.append((index, *got))
        return held

    def _try_admit(self, seq: Sequence) -> bool:
        held = self._acquire_affixes(seq)
        if held is None:
            return False
        need = self.pool.pages_for(seq.private_tokens([a.length for _, a, _ in held]))
        pages = self.pool.allocate(need)
        if pages is None and self.affixes.evict_until(need, keep={a.key for _, a, _ in held}):
            pages = self.pool.allocate(need)
        if pages is None:
            for _, affix, _ in held:
                self.affixes.release(affix)
            return False
        seq.affixes = [(index, affix) for index, affix, _ in held]
        seq.private_pages = pages
        seq.private_slots = self.pool.slots(pages, len(pages) * self.pool.page_size)
        seq.stats.private_pages = len(pages)
        seq.stats.affix_queries = len(held)
        seq.stats.affix_hits = sum(hit for _, _, hit in held)
        seq.status = Status.RUNNING
        seq.phase = Phase.SELECT
        return True

    def admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._try_admit(seq):
                break
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def schedule(self) -> ScheduledBatch:
        """Admits what fits, then splits the running requests by phase; each group is cut to the token
        budget (always at least one request) in arrival order."""
        self.admit()
        budget = self.config.max_num_batched_tokens
        groups: dict[Phase, list[Sequence]] = {p: [] for p in Phase}
        used: dict[Phase, int] = dict.fromkeys(Phase, 0)
        for seq in self.running:
            cost = self._cost(seq)
            if groups[seq.phase] and used[seq.phase] + cost > budget:
                continue
            groups[seq.phase].append(seq)
            used[seq.phase] += cost
        return ScheduledBatch(groups[Phase.SELECT], groups[Phase.REFRESH], groups[Phase.STEP])

    @staticmethod
    def _cost(seq: Sequence) -> int:
        if seq.phase is Phase.SELECT:
            return seq.length - seq.affix_tokens
        if seq.phase is Phase.REFRESH:
            return seq.recompute_count
        return seq.params.block_length

    def finish(self, seq: Sequence, status: Status = Status.FINISHED) -> None:
        self.running.remove(seq)
        self.pool.free(seq.private_pages)
        seq.private_pages = []
        for _, affix in seq.affixes:
            self.affixes.release(affix)
        seq.status = status
