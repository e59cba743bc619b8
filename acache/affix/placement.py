"""Placing shared affix K/V on a canvas: each affix's cached pre-RoPE K/V at its absolute columns."""

from __future__ import annotations

import torch

from acache.affix.context import CanvasKV
from acache.affix.entry import AffixEntry
from acache.decoding.canvas import Canvas
from acache.models.base import DiffusionLM

# (index of the affix's first token in the prompt, its cached entry), per row
Placements = list[list[tuple[int, AffixEntry]]]


def place_affixes(model: DiffusionLM, canvas: Canvas, placements: Placements) -> tuple[CanvasKV, torch.Tensor]:
    """Canvas K/V with each affix's cached K/V at its columns, and the affix slot of every column."""
    kv = CanvasKV.empty(model, canvas)
    slot = torch.full(canvas.tokens.shape, -1, dtype=torch.long, device=canvas.tokens.device)
    for row, items in enumerate(placements):
        for a, (index, entry) in enumerate(items):
            c0 = canvas.column(row, index)
            c1 = c0 + entry.length
            if canvas.column(row, index + entry.length - 1) != c1 - 1:
                raise ValueError(f"affix {entry.name or entry.key[:12]} of prompt {row} spans the generation region")
            if not torch.equal(canvas.tokens[row, c0:c1].cpu(), torch.tensor(entry.token_ids)):
                raise ValueError(f"affix {entry.name or entry.key[:12]} does not match prompt {row}'s tokens")
            slot[row, c0:c1] = a
            for layer in range(len(kv.keys)):
                kv.keys[layer][row, c0:c1] = entry.keys[layer]
                kv.values[layer][row, c0:c1] = entry.values[layer]
    return kv, slot
