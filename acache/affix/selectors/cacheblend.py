"""CacheBlend as published (Yao et al., 2024): the tokens whose K/V deviate most, found by gradual filtering.

Layer 0's K/V are context-free (a token's embedding alone), so the first stale layer is layer 1. Every token
is run through layers 0 and 1 in full context, and each affix token's layer-1 deviation
``sum_h ||K_full - K_cached|| + ||V_full - V_cached||`` is measured. Only the most deviating go on: at each
later layer the carried tokens (plus every non-affix token) are recomputed against the cached K/V of the
others, their deviation at that layer measured, and the most deviating kept. The number carried shrinks
linearly from ``min(n, 2k)`` at layer 1 to ``k = ceil(ratio * n)`` at the last layer, per affix; the tokens
kept there are the anchors. Unlike the ``kv-deviation`` oracle, no full forward is run past layer 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from acache.affix.context import SelectionContext, compact_index, kv_deviation
from acache.affix.selectors.base import AnchorSelector, anchor_count, keep_most


def carried_counts(k: int, n: int, steps: int) -> list[int]:
    """How many tokens of an ``n``-token affix are kept after each filtering step (layers 1..L-1), ending at
    ``k``: from ``min(n, 2k)`` down linearly."""
    start = min(n, 2 * k)
    if steps <= 1:
        return [k] * max(steps, 0)
    return [round(k + (start - k) * (steps - 1 - s) / (steps - 1)) for s in range(steps)]


class CacheBlendAnchors(AnchorSelector):
    name = "cacheblend"

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        raise NotImplementedError("CacheBlend selects by gradual filtering, not by one score: call select()")

    def select(self, ctx: SelectionContext, ratio: float | Sequence[float]) -> torch.Tensor:
        model, c = ctx.model, ctx.canvas
        b, t = c.tokens.shape
        ratios = [ratio] * b if isinstance(ratio, (int, float)) else list(ratio)
        layers = model.config.num_layers
        slots = int(ctx.affix_slot.max()) + 1 if ctx.affix_slot.numel() else 0
        affix = ctx.affix_mask & c.valid
        plan = [[carried_counts(anchor_count(ratios[row], int((ctx.affix_slot[row] == s).sum()), self.name),
                                int((ctx.affix_slot[row] == s).sum()), max(layers - 1, 1)) for s in range(slots)]
                for row in range(b)]
        if layers < 2:  # every K/V is context-free: nothing deviates; keep the first tokens
            return self._keep(ctx, torch.zeros(b, t, device=c.tokens.device), affix, plan, None)
        out = ctx.first_layers()  # layers 0 and 1 on every token, in full context
        hidden = torch.cat((out.hidden, out.hidden[:, :1]), 1)  # plus a trash column for padded writes
        width = hidden.shape[-1]
        carried = self._keep(ctx, ctx.first_stale_deviation(), affix, plan, 0)
        for layer in range(2, layers):
            fed, fed_valid = compact_index(c.valid & (~affix | carried), fill=t)
            cached, cached_valid = compact_index(affix & ~carried, fill=t)
            at = fed.clamp_max(t - 1)
            step = model.run_layers(hidden.gather(1, at[..., None].expand(-1, -1, width)),
                                    c.positions.gather(1, at), fed_valid,
                                    ctx.kv.gather_layer(cached, cached_valid, layer),
                                    range(layer, layer + 1), return_kv=True)
            hidden = hidden.scatter(1, fed[..., None].expand(-1, -1, width), step.hidden)
            fresh = kv_deviation(step.kv.keys[0], step.kv.values[0],
                                 ctx.kv.keys[layer].gather(1, at[..., None, None].expand_as(step.kv.keys[0])),
                                 ctx.kv.values[layer].gather(1, at[..., None, None].expand_as(step.kv.values[0])))
            # padded entries land in the trash column t, never on a real one
            dev = torch.zeros(b, t + 1, dtype=torch.float32, device=c.tokens.device).scatter_(1, fed, fresh)
            carried = self._keep(ctx, dev[:, :t], carried, plan, layer - 1)
        return carried

    @staticmethod
    def _keep(ctx: SelectionContext, scores: torch.Tensor, candidates: torch.Tensor, plan: list[list[list[int]]],
              step: int | None) -> torch.Tensor:
        """Per row and affix, the planned number of ``candidates`` with the highest ``scores`` at ``step``
        (the last planned count when ``step`` is None)."""
        kept = torch.zeros_like(candidates)
        for row in range(candidates.shape[0]):
            for slot, counts in enumerate(plan[row]):
                member = candidates[row] & (ctx.affix_slot[row] == slot)
                count = counts[step] if step is not None and counts else (counts[-1] if counts else 0)
                if count:
                    kept[row] |= keep_most(scores[row], member, count)
        return kept
