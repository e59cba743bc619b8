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

from acache.engine.page_pool import PagePool
from acache.models.kv import LayerView
from acache.models.layers import apply_rope, rope_tables


@dataclass
class StepKeys:
    refreshes: int  # the request's refresh count when they were gathered: a later refresh makes them stale
    keys: list[torch.Tensor]  # per layer [P, Hkv, D], rotated
    values: list[torch.Tensor]
    positions: torch.Tensor  # [P]


class StackedKV:
    """A batch's rotated step key sets, padded to the longest, with ``room`` free columns after them per layer.

    A step feeds ``room`` tokens; their fresh keys are written into the room in place of concatenating them to
    the stacked set (``DecoderLayer``'s ``fill``), so a batch that steps again with the same sets reuses the
    stack and copies nothing per layer but its own block. ``keys[l]`` is the set alone (a view), ``full_keys[l]``
    the set with its room; a layer's buffers are built when the model first reaches it."""

    rotated = True

    def __init__(self, sets: list[StepKeys], device: torch.device, room: int = 0) -> None:
        width = max(s.positions.numel() for s in sets)
        self._sets, self.width, self.room = sets, width, room
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_layers = len(sets[0].keys)
        self.positions = torch.zeros(len(sets), width, dtype=torch.long, device=device)
        self.mask = torch.zeros(len(sets), width, dtype=torch.bool, device=device)
        for i, s in enumerate(sets):
            n = s.positions.numel()
            self.positions[i, :n] = s.positions
            self.mask[i, :n] = True
        self.keys = LayerView(lambda i: self._layer(i)[0][:, :width], self.num_layers)
        self.values = LayerView(lambda i: self._layer(i)[1][:, :width], self.num_layers)
        self.full_keys = LayerView(lambda i: self._layer(i)[0], self.num_layers)
        self.full_values = LayerView(lambda i: self._layer(i)[1], self.num_layers)

    def _layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self._layers:
            first = self._sets[0].keys[index]
            shape = (len(self._sets), self.width + self.room, *first.shape[1:])
            keys, values = first.new_zeros(shape), first.new_zeros(shape)
            for i, s in enumerate(self._sets):
                keys[i, :s.keys[index].shape[0]] = s.keys[index]
                values[i, :s.values[index].shape[0]] = s.values[index]
            self._layers[index] = keys, values
        return self._layers[index]


class StepKeyCache:
    """Per running request, its current step key set; entries of requests no step uses any more are dropped."""

    def __init__(self, pool: PagePool, head_dim: int, rope_theta: float) -> None:
        self.pool, self.head_dim, self.rope_theta = pool, head_dim, rope_theta
        self.entries: dict[str, StepKeys] = {}
        # per in-block batch (its requests), its stack and what it was built from: a step may run several such
        # batches (other block lengths, caches, FOCUS), each reusing its own
        self._stacks: dict[tuple[str, ...], tuple[tuple, StackedKV]] = {}
        self._used: set[tuple[str, ...]] = set()  # the batches that stepped since the last keep_only

    def get(self, request_id: str, refreshes: int, slots: torch.Tensor, positions: torch.Tensor) -> StepKeys:
        entry = self.entries.get(request_id)
        if entry is None or entry.refreshes != refreshes:
            cos, sin = rope_tables(positions[None], self.head_dim, self.rope_theta)
            keys = [apply_rope(k[slots][None], cos, sin)[0] for k in self.pool.keys]
            entry = StepKeys(refreshes, keys, [v[slots] for v in self.pool.values], positions)
            self.entries[request_id] = entry
        return entry

    def stacked(self, request_ids: list[str], sets: list[StepKeys], room: int, device: torch.device) -> StackedKV:
        """The batch's stack: its last one again when the same requests step with the same sets and the same
        number of fed tokens (every step of a block after the first), a new one otherwise."""
        # the same set objects (the stack holds them, so no id is reused while it lives), not equal values
        batch = tuple(request_ids)
        key = (batch, tuple(id(s) for s in sets), room)
        held = self._stacks.get(batch)
        if held is None or held[0] != key:
            # a request steps in one batch: a stack it had in another is out of date, and freed before this one
            self._stacks = {b: h for b, h in self._stacks.items() if not set(b) & set(batch)}
            held = self._stacks[batch] = key, StackedKV(sets, device, room)
        self._used.add(batch)
        return held[1]

    def nbytes(self) -> int:
        """Bytes of the copies held now: every request's set and each batch's stack (outside the pool, so the
        pool's page count leaves them out)."""
        held = sum(t.numel() * t.element_size() for e in self.entries.values() for t in (*e.keys, *e.values))
        return held + sum(t.numel() * t.element_size() for _, stack in self._stacks.values()
                          for pair in stack._layers.values() for t in pair)

    def drop(self, request_id: str) -> None:
        """Forgets a request that left the engine (its copies would otherwise live until the next step)."""
        self.entries.pop(request_id, None)
        self._stacks = {batch: held for batch, held in self._stacks.items() if request_id not in batch}

    def keep_only(self, request_ids: set[str]) -> None:
        """Keeps the sets of ``request_ids`` (this step's in-block requests) and the stacks of the batches that
        stepped since the last call and hold none but them."""
        self.entries = {k: v for k, v in self.entries.items() if k in request_ids}
        self._stacks = {batch: held for batch, held in self._stacks.items()
                        if batch in self._used and set(batch) <= request_ids}
        self._used = set()
