"""CacheBlend-style oracle: the affix tokens whose K/V move most when computed in context."""

from __future__ import annotations

import torch

from acache.affix.context import SelectionContext, kv_deviation
from acache.affix.selectors.base import AnchorSelector


class KVDeviationAnchors(AnchorSelector):
    """``score(j) = sum_{l,h} ||K_full - K_cached||_2 + ||V_full - V_cached||_2`` from one full forward.

    It keeps that pass of its own (no ``anchor_pass="one"``): it needs every layer's in-context K/V of every affix
    token, which a refresh that recomputes only some of them never holds."""

    name = "kv-deviation"

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        full = ctx.full().kv
        t = ctx.canvas.total
        score = torch.zeros(ctx.affix_slot.shape, dtype=torch.float32, device=ctx.affix_slot.device)
        for layer in range(full.num_layers):
            score += kv_deviation(full.keys[layer], full.values[layer], ctx.kv.keys[layer][:, :t],
                                  ctx.kv.values[layer][:, :t])
        return ctx.model.reduce_heads(score)
