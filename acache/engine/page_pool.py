"""One K/V pool of fixed-size pages for every layer, sized from a memory budget.

Slot ``s`` of a layer's tensor is token ``s % page_size`` of page ``s // page_size``; one extra slot
at the end (:attr:`PagePool.trash_slot`) absorbs the writes of padded entries so batches need no masks
on write.
"""

from __future__ import annotations

from collections import deque

import torch

from acache.models.config import ModelConfig
from acache.models.kv import LayerView, LayerwiseKV


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page: K and V of ``page_size`` tokens in every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * elem


class PagePool:
    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_pages <= 0:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_layers = config.num_layers
        self.page_bytes = page_bytes(config, page_size, dtype)
        shape = (num_pages * page_size + 1, config.num_kv_heads, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.trash_slot = num_pages * page_size
        self._free: deque[int] = deque(range(num_pages))
        self.peak_pages_used = 0

    @classmethod
    def from_budget(cls, config: ModelConfig, page_size: int, dtype: torch.dtype, device: torch.device,
                    memory_bytes: int) -> PagePool:
        """As many pages as ``memory_bytes`` holds (:meth:`EngineConfig.kv_budget` resolves the budget)."""
        pages = memory_bytes // page_bytes(config, page_size, dtype)
        if pages <= 0:
            raise ValueError(f"kv_cache_memory of {memory_bytes} bytes holds no page of "
                             f"{page_bytes(config, page_size, dtype)} bytes")
        return cls(config, int(pages), page_size, dtype, device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, num_pages: int) -> list[int] | None:
        """``num_pages`` pages, or None (and nothing taken) when fewer are free."""
        if num_pages > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(num_pages)]
        self.peak_pages_used = max(self.peak_pages_used, self.num_used)
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def slots(self, pages: list[int], count: int, device: torch.device | None = None) -> torch.Tensor:
        """The first ``count`` slots of ``pages``, in order."""
        offsets = torch.arange(self.page_size)
        all_slots = (torch.tensor(pages, dtype=torch.long)[:, None] * self.page_size + offsets).flatten()
        return all_slots[:count].to(device or self.keys[0].device)

    def write(self, slots: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
              layers: range | None = None) -> None:
        """Writes per-layer ``[..., Hkv, D]`` K/V at ``slots`` (same leading shape); ``keys[j]`` goes to
        layer ``layers[j]`` (default: every layer)."""
        flat = slots.reshape(-1)
        layers = layers if layers is not None else range(self.num_layers)
        for j, layer in enumerate(layers):
            self.keys[layer][flat] = keys[j].reshape(-1, *keys[j].shape[-2:]).to(self.keys[layer].dtype)
            self.values[layer][flat] = values[j].reshape(-1, *values[j].shape[-2:]).to(self.values[layer].dtype)


class PagedKV(LayerwiseKV):
    """A key set read through a slot map: what the model attends to, gathered layer by layer from the
    pool (shared affix pages and private pages alike); pre-RoPE keys, rotated at attend time."""

    def __init__(self, pool: PagePool, slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__(LayerView(lambda layer: pool.keys[layer][slots], pool.num_layers),
                         LayerView(lambda layer: pool.values[layer][slots], pool.num_layers), positions, mask)
        self.slots = slots
