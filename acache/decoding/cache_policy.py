"""Intra-request KV cache policies (Fast-dLLM): which columns a step feeds, and which KV it reuses.

A policy is asked for a :class:`StepPlan` before every forward. On a refresh step the whole canvas
is fed and the policy keeps the part of its K/V it will reuse until the next refresh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from acache.models.kv import KVCache


def commits_block_head(cache: str, refresh_interval: int | None) -> bool:
    """Whether a shifted model must commit a block's first token on its first step: true when later
    steps feed the block without the column before it (every cache but none, unless every step is a
    refresh)."""
    return cache != "none" and refresh_interval != 1


@dataclass
class StepPlan:
    """What one forward feeds. ``cols`` is a slice of canvas columns shared by all rows, or a per-row
    index ``[B, F]`` (then ``cols_valid`` marks the real entries); ``block`` locates the current block's
    columns among the fed ones, as a slice or a per-row ``[B, L]`` index."""

    cols: slice | torch.Tensor
    past: KVCache | None  # cached K/V the fed columns attend to besides themselves
    refresh: bool  # whether the step's K/V is to be handed back through ``store``
    block: slice | torch.Tensor
    cols_valid: torch.Tensor | None = None
    # a policy that splits the refresh over layers (BiCache) runs it itself: (ids, positions, valid) -> output
    forward: Callable | None = None


class CachePolicy:
    name = "none"

    def __init__(self, refresh_interval: int | None = None) -> None:
        self.refresh_interval = refresh_interval
        self.kv: KVCache | None = None

    @property
    def commits_block_head(self) -> bool:
        return commits_block_head(self.name, self.refresh_interval)

    def is_refresh(self, step: int) -> bool:
        if step == 0:
            return True
        return self.refresh_interval is not None and step % self.refresh_interval == 0

    def begin(self, model, canvas) -> None:
        """Called once per batch before the first block, on the all-mask canvas."""
        self.kv = None

    def plan(self, step: int, start: int, end: int, total: int) -> StepPlan:
        return StepPlan(slice(0, total), None, False, slice(start, end))

    def store(self, kv: KVCache, plan: StepPlan, start: int, end: int) -> None:
        """Keeps what later steps of block ``[start, end)`` reuse from the refresh that ``plan`` fed."""


class NoCache(CachePolicy):
    """Every step is a full forward of the whole canvas."""

    name = "none"


class PrefixCache(CachePolicy):
    """Reuses the K/V of everything before the block; feeds the block and everything after it."""

    name = "prefix"

    def plan(self, step: int, start: int, end: int, total: int) -> StepPlan:
        if self.is_refresh(step):
            return StepPlan(slice(0, total), None, True, slice(start, end))
        return StepPlan(slice(start, total), self.kv, False, slice(0, end - start))

    def store(self, kv: KVCache, plan: StepPlan, start: int, end: int) -> None:
        self.kv = kv.columns(slice(0, start))


class DualCache(CachePolicy):
    """Reuses the K/V of everything before and after the block; feeds only the block."""

    name = "dual"

    def plan(self, step: int, start: int, end: int, total: int) -> StepPlan:
        if self.is_refresh(step):
            return StepPlan(slice(0, total), None, True, slice(start, end))
        return StepPlan(slice(start, end), self.kv, False, slice(0, end - start))

    def store(self, kv: KVCache, plan: StepPlan, start: int, end: int) -> None:
        self.kv = KVCache.cat([kv.columns(slice(0, start)), kv.columns(slice(end, kv.length))])


CACHE_POLICIES: dict[str, type[CachePolicy]] = {c.name: c for c in (NoCache, PrefixCache, DualCache)}


def make_cache_policy(name: str, refresh_interval: int | None = None) -> CachePolicy:
    try:
        return CACHE_POLICIES[name](refresh_interval)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; known: {', '.join(CACHE_POLICIES)}") from None
