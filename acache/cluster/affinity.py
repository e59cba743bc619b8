"""The routing rule, apart from Ray: the replica holding the most of a request's affix tokens, unless its
queue is longer than the shortest by both margins of :class:`Balance`. Spans no replica holds or has seen
go to the replica holding the fewest affix tokens (so that new documents spread over the replicas' caches
instead of piling onto one), under the same load check; a request without spans goes to the least loaded."""

from __future__ import annotations

from dataclasses import dataclass

from acache.cluster.directory import Holding


@dataclass(frozen=True)
class Balance:
    """When affinity yields to load. SGLang's cache-aware router calls the load imbalanced when the longest
    queue exceeds the shortest by more than ``absolute`` requests and by more than ``relative`` times; its
    defaults (64 and 1.5) are kept, since an engine replica decodes up to ``max_num_seqs`` requests at once
    and queues the rest, so a few dozen queued requests is a normal backlog, not a hot spot."""

    absolute: int = 64
    relative: float = 1.5

    def __post_init__(self) -> None:
        if isinstance(self.absolute, bool) or not isinstance(self.absolute, int) or self.absolute < 0:
            raise ValueError(f"the absolute balance threshold must be an integer >= 0, got {self.absolute!r}")
        if not self.relative >= 1.0:
            raise ValueError(f"the relative balance threshold must be >= 1.0, got {self.relative!r}")

    def overloaded(self, load: int, least: int) -> bool:
        return load - least > self.absolute and load > self.relative * least


def rank_replicas(replicas: list[str], loads: dict[str, int], holdings: dict[str, Holding],
                  balance: Balance = Balance()) -> list[str]:
    """Replicas in order of preference. ``holdings`` per replica covers the request's spans (empty: the
    request has none)."""
    if not replicas:
        return []
    least = min(loads.get(r, 0) for r in replicas)

    def by_load(r: str) -> tuple:
        return loads.get(r, 0), holdings.get(r, Holding()).total, r

    def affinity(r: str) -> tuple[int, int]:
        h = holdings.get(r, Holding())
        return h.held, h.seen

    ranked = sorted(replicas, key=by_load)
    best = max(affinity(r) for r in replicas)
    if best == (0, 0):
        if not holdings:
            return ranked
        favoured = sorted(replicas, key=lambda r: (holdings.get(r, Holding()).total, loads.get(r, 0), r))[:1]
    else:
        favoured = [r for r in ranked if affinity(r) == best]
    if balance.overloaded(loads.get(favoured[0], 0), least):
        return ranked
    rest = sorted((r for r in replicas if r not in favoured), key=lambda r: (*(-a for a in affinity(r)), by_load(r)))
    return favoured + rest
