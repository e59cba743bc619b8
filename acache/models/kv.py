"""The explicit key set a forward pass attends to: per-layer pre-RoPE K/V at given absolute positions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Pre-RoPE keys and values of a set of tokens, for every layer.

    ``keys[l]`` and ``values[l]`` are ``[B, S, Hkv, D]``; ``positions`` ``[B, S]`` are the absolute
    positions the keys are rotated to when attended; ``mask`` ``[B, S]`` marks the slots that exist
    (False for padding). Rows of a batch may hold different positions.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    mask: torch.Tensor
    rotated: bool = False  # keys already rotated to ``positions`` (a key set reused across steps)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise ValueError(f"KVCache has {len(self.keys)} key layers but {len(self.values)} value layers")
        if self.positions.shape != self.mask.shape:
            raise ValueError(f"KVCache positions {tuple(self.positions.shape)} and mask "
                             f"{tuple(self.mask.shape)} differ in shape")
        for k, v in zip(self.keys, self.values, strict=True):
            if k.shape != v.shape or k.shape[:2] != self.positions.shape:
                raise ValueError(f"KVCache layer shapes {tuple(k.shape)}/{tuple(v.shape)} do not match "
                                 f"positions {tuple(self.positions.shape)}")

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in zip(self.keys, self.values, strict=True))

    def columns(self, cols: slice | torch.Tensor) -> KVCache:
        """The same columns of every row (a slice or a 1-D index tensor)."""
        return KVCache([k[:, cols] for k in self.keys], [v[:, cols] for v in self.values],
                       self.positions[:, cols], self.mask[:, cols], self.rotated)

    def gather(self, index: torch.Tensor) -> KVCache:
        """Per-row columns: ``index`` ``[B, S']`` selects different columns in each row."""
        def take(t: torch.Tensor) -> torch.Tensor:
            expanded = index[:, :, None, None].expand(-1, -1, t.shape[2], t.shape[3])
            return torch.gather(t, 1, expanded)

        return KVCache([take(k) for k in self.keys], [take(v) for v in self.values],
                       torch.gather(self.positions, 1, index), torch.gather(self.mask, 1, index), self.rotated)

    @staticmethod
    def cat(parts: list[KVCache]) -> KVCache:
        """Concatenates key sets along the token axis (all rotated to their positions, or none)."""
        if len(parts) == 1:
            return parts[0]
        if len({p.rotated for p in parts}) > 1:
            raise ValueError("cannot concatenate rotated and unrotated key sets: the rotated ones would turn again")
        layers = range(parts[0].num_layers)
        return KVCache(
            [torch.cat([p.keys[i] for p in parts], dim=1) for i in layers],
            [torch.cat([p.values[i] for p in parts], dim=1) for i in layers],
            torch.cat([p.positions for p in parts], dim=1),
            torch.cat([p.mask for p in parts], dim=1),
            parts[0].rotated,
        )


class LayerView:
    """``view[l]`` is ``layer(l)``, computed when the model reaches layer ``l``, not before: a key set read
    from the pool, or assembled, one layer at a time."""

    def __init__(self, layer: Callable[[int], torch.Tensor], num_layers: int) -> None:
        self.layer, self.num_layers = layer, num_layers

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.layer(layer)

    def __len__(self) -> int:
        return self.num_layers


class LayerwiseKV:
    """A key set like :class:`KVCache` whose layers are produced when a forward reaches them (a gather from
    the page pool, or keys rotated once for several readers), so no layer is held before it is needed."""

    def __init__(self, keys: LayerView, values: LayerView, positions: torch.Tensor, mask: torch.Tensor,
                 rotated: bool = False) -> None:
        self.keys, self.values, self.positions, self.mask, self.rotated = keys, values, positions, mask, rotated
        self.num_layers = len(keys)
