"""ACache on the dual cache: the cache policy that reuses shared affix K/V and recomputes anchors.

Per request, once, on the all-mask canvas: place each affix's cached K/V at its absolute positions
and let the selector choose anchors. At every refresh (each block start): feed the anchors and every
non-affix token (the prompt's own tokens and the whole generation region) against the cached K/V of
the other affix tokens, which are never recomputed. Inside a block: feed only the block, as the dual
cache does. With every affix token an anchor this is exactly the dual cache; with none, direct reuse.

One exception, for shifted models (Dream) only: when an affix ends right before the generation region,
its last token's state predicts the first generated token, so that token is refreshed like an anchor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from acache.affix.context import CanvasKV, SelectionContext, compact_index
from acache.affix.selectors.base import AnchorSelector
from acache.affix.store import AffixEntry
from acache.decoding.cache_policy import CachePolicy, StepPlan
from acache.decoding.canvas import Canvas
from acache.models.base import DiffusionLM
from acache.models.kv import KVCache

# (index of the affix's first token in the prompt, its cached entry), per row
Placements = list[list[tuple[int, AffixEntry]]]


@dataclass
class AnchorPlan:
    affix_slot: torch.Tensor  # [B, T], -1 outside affixes
    anchors: torch.Tensor  # [B, T] bool
    recompute: torch.Tensor  # [B, T] bool: what every refresh feeds
    selection_time_s: float


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


class AffixDualCache(CachePolicy):
    name = "affix"

    def __init__(self, placements: Placements, selector: AnchorSelector, ratio: float,
                 row_seeds: list[int] | None = None, refresh_interval: int | None = None) -> None:
        super().__init__(refresh_interval)
        self.placements = placements
        self.selector = selector
        self.ratio = ratio
        self.row_seeds = row_seeds
        self.anchor_plan: AnchorPlan | None = None

    def begin(self, model: DiffusionLM, canvas: Canvas) -> None:
        self.kv = None
        self.total = canvas.total
        self.buf, slot = place_affixes(model, canvas, self.placements)
        ctx = SelectionContext(model, canvas, slot, self.buf, self.row_seeds)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        t0 = time.perf_counter()
        anchors = self.selector.select(ctx, self.ratio) & ctx.affix_mask
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        elapsed = time.perf_counter() - t0
        recompute = canvas.valid & (~ctx.affix_mask | anchors)
        if model.shifted_logits and canvas.gen_start > 0:
            # the state before the generation region predicts its first token: it must be fresh
            recompute[:, canvas.gen_start - 1] |= canvas.valid[:, canvas.gen_start - 1]
        self.anchor_plan = AnchorPlan(slot, anchors, recompute, elapsed)
        self.fed, self.fed_valid = compact_index(recompute, fill=self.total)
        self.cached, self.cached_valid = compact_index(ctx.affix_mask & ~recompute, fill=self.total)
        self.fed_position = recompute.long().cumsum(-1) - 1  # where each fed column sits among the fed

    def plan(self, step: int, start: int, end: int, total: int) -> StepPlan:
        if self.is_refresh(step):
            past = self.buf.gather(self.cached, self.cached_valid) if self.cached.shape[1] else None
            return StepPlan(self.fed.clamp_max(self.total - 1), past, True, self.fed_position[:, start:end],
                            self.fed_valid)
        return StepPlan(slice(start, end), self.kv, False, slice(0, end - start))

    def store(self, kv: KVCache, plan: StepPlan, start: int, end: int) -> None:
        self.buf.scatter(self.fed, kv)
        self.kv = self.buf.outside(start, end)
