"""The project's own selector: the affix tokens whose staleness the masks would read most.

A stale cached token ``j`` perturbs what a mask position reads by about its attention weight times how far
its K/V are from their in-context values. So the score is ``I(j) * D(j)``: ACache's attention mass of the
masks on ``j`` (the serving-path probe, DESIGN §4.3) times ``j``'s K/V deviation at layer 1, the first
layer that goes stale (CacheBlend's measure). Attention alone keeps tokens that are read but barely stale;
deviation alone keeps tokens that are stale but unread.

The deviation is measured only for the ``min(n, 2k)`` tokens of each affix the masks attend to most (``k``
the anchor count): exact there (:meth:`SelectionContext.stale_deviation`), at the cost of layers 0 and 1
for those tokens and the non-affix ones, not for the whole canvas. The anchors are the ``k`` of those
candidates with the largest product.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from acache.affix.context import SelectionContext
from acache.affix.selectors.attention import AttentionAnchors
from acache.affix.selectors.base import AnchorSelector, anchor_count, keep_most


class AttentionDeviationAnchors(AnchorSelector):
    name = "attention-deviation"

    def __init__(self, query: str = "probe") -> None:
        self.attention = AttentionAnchors(query)

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        raise NotImplementedError("attention-deviation scores its attention candidates only: call select()")

    def select(self, ctx: SelectionContext, ratio: float | Sequence[float]) -> torch.Tensor:
        rows = ctx.affix_slot.shape[0]
        ratios = [ratio] * rows if isinstance(ratio, (int, float)) else list(ratio)
        mass = self.attention.scores(ctx).float()
        slots = int(ctx.affix_slot.max()) + 1 if ctx.affix_slot.numel() else 0
        counts = [[anchor_count(ratios[r], int((ctx.affix_slot[r] == s).sum()), self.name) for s in range(slots)]
                  for r in range(rows)]
        candidates = torch.zeros_like(ctx.affix_mask)
        for r in range(rows):
            for s in range(slots):
                member = ctx.affix_slot[r] == s
                candidates[r] |= keep_most(mass[r], member, min(int(member.sum()), 2 * counts[r][s]))
        product = mass * ctx.stale_deviation(candidates)
        anchors = torch.zeros_like(candidates)
        for r in range(rows):
            for s in range(slots):
                anchors[r] |= keep_most(product[r], candidates[r] & (ctx.affix_slot[r] == s), counts[r][s])
        return anchors
