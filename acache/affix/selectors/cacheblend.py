"""CacheBlend as published (Yao et al., 2024): the tokens whose K/V deviate most, found by gradual filtering.

Layer 0's K/V are context-free (a token's embedding alone), so the first stale layer is layer 1. Every token
is run through layers 0 and 1 in full context, and each affix token's layer-1 deviation
``sum_h ||K_full - K_cached|| + ||V_full - V_cached||`` is measured. Only the most deviating go on: at each
later layer the carried tokens (plus every non-affix token) are recomputed against the cached K/V of the
others, their deviation at that layer measured, and the most deviating kept. The number carried shrinks
linearly from ``min(n, 2k)`` at layer 1 to ``k = ceil(ratio * n)`` at the last layer, per affix; the tokens
kept there are the anchors. Unlike the ``kv-deviation`` oracle, no full forward is run past layer 1.

That selection is a refresh's forward, so its one-pass form (``anchor_pass="one"``, the default) runs it as the
request's first refresh and keeps its K/V: the same anchors, no pass of its own (:mod:`acache.affix.one_pass`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from acache.affix.context import SelectionContext, compact_index, kv_deviation
from acache.affix.selectors.base import (
    AnchorSelector,
    OnePass,
    affix_sizes,
    anchor_candidates,
    anchor_counts,
    carried_counts,
    keep_per_affix,
    plan_tensor,
)


class CacheBlendAnchors(AnchorSelector):
    name = "cacheblend"
    one_pass = OnePass(deviation=True)  # the published selection is a refresh's forward: the same anchors

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        raise NotImplementedError("CacheBlend selects by gradual filtering, not by one score: call select()")

    def select(self, ctx: SelectionContext, ratio: float | Sequence[float]) -> torch.Tensor:
        model, c = ctx.model, ctx.canvas
        b, t = c.tokens.shape
        layers = model.config.num_layers
        affix = ctx.affix_mask & c.valid
        free = anchor_candidates(ctx)  # the affix columns a refresh would read from the cache: where anchors go
        steps = max(layers - 1, 1)
        plan = plan_tensor([[carried_counts(k, n, steps) for k, n in zip(counts, sizes, strict=True)]
                            for counts, sizes in zip(anchor_counts(ctx, ratio, self.name), affix_sizes(ctx, free),
                                                     strict=True)], steps, c.tokens.device)

        def keep(scores: torch.Tensor, candidates: torch.Tensor, step: int) -> torch.Tensor:
            return keep_per_affix(ctx.affix_slot, scores, candidates, plan[step])

        if layers < 2:  # every K/V is context-free: nothing deviates; keep the first tokens
            return keep(torch.zeros(b, t, device=c.tokens.device), free, 0)
        out = ctx.first_layers()  # layers 0 and 1 on every token, in full context
        hidden = torch.cat((out.hidden, out.hidden[:, :1]), 1)  # plus a trash column for padded writes
        width = hidden.shape[-1]
        carried = keep(ctx.first_stale_deviation(), free, 0)
        fresh_anyway = ~affix if ctx.own is None else ~affix | ctx.own  # the affix columns every refresh recomputes
        for layer in range(2, layers):
            fed, fed_valid = compact_index(c.valid & (fresh_anyway | carried), fill=t)
            cached, cached_valid = compact_index(affix & ~fresh_anyway & ~carried, fill=t)
            at = fed.clamp_max(t - 1)
            step = model.run_layers(hidden.gather(1, at[..., None].expand(-1, -1, width)),
                                    c.positions.gather(1, at), fed_valid,
                                    ctx.kv.gather_layer(cached, cached_valid, layer),
                                    range(layer, layer + 1), return_kv=True)
            hidden = hidden.scatter(1, fed[..., None].expand(-1, -1, width), step.hidden)
            fresh = model.reduce_heads(kv_deviation(
                step.kv.keys[0], step.kv.values[0],
                ctx.kv.keys[layer].gather(1, at[..., None, None].expand_as(step.kv.keys[0])),
                ctx.kv.values[layer].gather(1, at[..., None, None].expand_as(step.kv.values[0]))))
            # padded entries land in the trash column t, never on a real one
            dev = torch.zeros(b, t + 1, dtype=torch.float32, device=c.tokens.device).scatter_(1, fed, fresh)
            carried = keep(dev[:, :t], carried, layer - 1)
        return carried
