"""Intra-request KV cache policies (Fast-dLLM): which columns a step feeds, and which KV it reuses.

A policy is asked for a :class:`StepPlan` before every forward. On a refresh step the whole canvas
is fed and the policy keeps the part of its K/V it will reuse until the next refresh.
"""

from __future__ import annotations

from dataclasses import dataclass

from acache.models.kv import KVCache


@dataclass
class StepPlan:
    cols: slice  # canvas columns fed to the model this step
    past: KVCache | None  # cached K/V the fed columns attend to besides themselves
    refresh: bool  # whether the step's K/V is to be handed back through ``store``


class CachePolicy:
    name = "none"

    def __init__(self, refresh_interval: int | None = None) -> None:
        self.refresh_interval = refresh_interval
        self.kv: KVCache | None = None

    def is_refresh(self, step: int) -> bool:
        if step == 0:
            return True
        return self.refresh_interval is not None and step % self.refresh_interval == 0

    def plan(self, step: int, start: int, end: int, total: int) -> StepPlan:
        return StepPlan(slice(0, total), None, False)

    def store(self, kv: KVCache, start: int, end: int) -> None:
        """Keeps what later steps of block ``[start, end)`` reuse from a refresh of the whole canvas."""


class NoCache(CachePolicy):
    """Every step is a full forward of the whole canvas."""

    name = "none"


class PrefixCache(CachePolicy):
    """Reuses the K/V of everything before the block; feeds the block and everything after it."""

    name = "prefix"

    def plan(self, step: int, start: int, end: int, total: int) -> StepPlan:
        if self.is_refresh(step):
            return StepPlan(slice(0, total), None, True)
        return StepPlan(slice(start, total), self.kv, False)

    def store(self, kv: KVCache, start: int, end: int) -> None:
        self.kv = kv.columns(slice(0, start))


class DualCache(CachePolicy):
    """Reuses the K/V of everything before and after the block; feeds only the block."""

    name = "dual"

    def plan(self, step: int, start: int, end: int, total: int) -> StepPlan:
        if self.is_refresh(step):
            return StepPlan(slice(0, total), None, True)
        return StepPlan(slice(start, end), self.kv, False)

    def store(self, kv: KVCache, start: int, end: int) -> None:
        self.kv = KVCache.cat([kv.columns(slice(0, start)), kv.columns(slice(end, kv.length))])


CACHE_POLICIES: dict[str, type[CachePolicy]] = {c.name: c for c in (NoCache, PrefixCache, DualCache)}


def make_cache_policy(name: str, refresh_interval: int | None = None) -> CachePolicy:
    try:
        return CACHE_POLICIES[name](refresh_interval)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; known: {', '.join(CACHE_POLICIES)}") from None
