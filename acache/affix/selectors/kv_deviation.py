"""CacheBlend-style oracle: the affix tokens whose K/V move most when computed in context."""

from __future__ import annotations

import torch

from acache.affix.context import SelectionContext
from acache.affix.selectors.base import AnchorSelector


class KVDeviationAnchors(AnchorSelector):
    """``score(j) = sum_{l,h} ||K_full - K_cached||_2 + ||V_full - V_cached||_2`` from one full forward."""

    name = "kv-deviation"

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        full = ctx.full().kv
        t = ctx.canvas.total
        score = torch.zeros(ctx.affix_slot.shape, dtype=torch.float32, device=ctx.affix_slot.device)
        for layer in range(full.num_layers):
            dk = (full.keys[layer].float() - ctx.kv.keys[layer][:, :t].float()).norm(dim=-1).sum(-1)
            dv = (full.values[layer].float() - ctx.kv.values[layer][:, :t].float()).norm(dim=-1).sum(-1)
            score += dk + dv
        return score
