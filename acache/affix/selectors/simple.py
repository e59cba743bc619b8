"""Selectors that need no forward pass: direct reuse, full recompute, EPIC's first tokens, random."""

from __future__ import annotations

import torch

from acache.affix.context import SelectionContext
from acache.affix.selectors.base import AnchorSelector


class NoAnchors(AnchorSelector):
    """Direct reuse: no affix token is recomputed, whatever the ratio (its count is zero)."""

    name = "none"

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        return torch.zeros(ctx.affix_slot.shape, device=ctx.affix_slot.device)


class AllAnchors(NoAnchors):
    """Full recompute: every affix token is recomputed, whatever the ratio (its count is the affix)."""

    name = "all"


class FirstK(AnchorSelector):
    """EPIC-style: the first tokens of each affix."""

    name = "first-k"

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        cols = torch.arange(ctx.canvas.total, device=ctx.affix_slot.device, dtype=torch.float32)
        return -cols.expand_as(ctx.affix_slot)


class RandomAnchors(AnchorSelector):
    """Uniformly random affix tokens, drawn from each request's own seed (``ctx.row_seeds``) over its own
    tokens, so a request's anchors do not depend on its batch."""

    name = "random"

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        valid = ctx.canvas.valid
        scores = torch.zeros(valid.shape, dtype=torch.float32)
        seeds = ctx.row_seeds or [0] * valid.shape[0]
        for row, seed in enumerate(seeds):
            gen = torch.Generator().manual_seed(seed)
            scores[row, valid[row].cpu()] = torch.rand(int(valid[row].sum()), generator=gen)
        return scores.to(valid.device)
