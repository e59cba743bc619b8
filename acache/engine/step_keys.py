"""The key set of a request's in-block steps, gathered and rotated once a refresh instead of at every step.

Between two refreshes a request's in-block steps attend to the same cached columns (the plan's ``past``),
whose K/V do not change: the pool is written only by refreshes. So the first step after a refresh gathers
those columns' K/V from the pool and rotates the keys to their positions (the same arithmetic the model does
at attend time), and the later steps of the block reuse them. A batch stacks its requests' sets layer by
layer, when the model reaches each layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from acache.engine.page_pool import LayerView, PagePool
from acache.models.layers import apply_rope, rope_tables


@dataclass
class StepKeys:
    refreshes: int  # the request's refresh count when they were gathered: a later refresh makes them stale
    keys: list[torch.Tensor]  # per layer [P, Hkv, D], rotated
    values: list[torch.Tensor]
    positions: torch.Tensor  # [P]


def _stacked(rows: list[list[torch.Tensor]], width: int) -> LayerView:
    """Layer ``l`` of every row's set, padded to the longest, built when first asked for."""
    def layer(index: int) -> torch.Tensor:
        first = rows[0][index]
        out = first.new_zeros(len(rows), width, *first.shape[1:])
        for i, row in enumerate(rows):
            out[i, :row[index].shape[0]] = row[index]
        return out

    return LayerView(layer, len(rows[0]))


class StackedKV:
    """A batch's rotated step key sets, read layer by layer like the pool's own view."""

    rotated = True

    def __init__(self, sets: list[StepKeys], device: torch.device) -> None:
        width = max(s.positions.numel() for s in sets)
        self.keys = _stacked([s.keys for s in sets], width)
        self.values = _stacked([s.values for s in sets], width)
        self.positions = torch.zeros(len(sets), width, dtype=torch.long, device=device)
        self.mask = torch.zeros(len(sets), width, dtype=torch.bool, device=device)
        for i, s in enumerate(sets):
            n = s.positions.numel()
            self.positions[i, :n] = s.positions
            self.mask[i, :n] = True
        self.num_layers = len(self.keys)


class StepKeyCache:
    """Per running request, its current step key set; entries of requests no step uses any more are dropped."""

    def __init__(self, pool: PagePool, head_dim: int, rope_theta: float) -> None:
        self.pool, self.head_dim, self.rope_theta = pool, head_dim, rope_theta
        self.entries: dict[str, StepKeys] = {}

    def get(self, request_id: str, refreshes: int, slots: torch.Tensor, positions: torch.Tensor) -> StepKeys:
        entry = self.entries.get(request_id)
        if entry is None or entry.refreshes != refreshes:
            cos, sin = rope_tables(positions[None], self.head_dim, self.rope_theta)
            keys = [apply_rope(k[slots][None], cos, sin)[0] for k in self.pool.keys]
            entry = StepKeys(refreshes, keys, [v[slots] for v in self.pool.values], positions)
            self.entries[request_id] = entry
        return entry

    def keep_only(self, request_ids: set[str]) -> None:
        self.entries = {k: v for k, v in self.entries.items() if k in request_ids}
