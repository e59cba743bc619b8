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

One pass (``anchor_pass="one"``, the default): inside the first refresh, mass (summed over the layers so far)
times that layer's deviation filters the candidates layer by layer (:mod:`acache.affix.one_pass`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from acache.affix.context import SelectionContext
from acache.affix.selectors.attention import AttentionAnchors
from acache.affix.selectors.base import (
    AnchorSelector,
    OnePass,
    affix_sizes,
    anchor_candidates,
    anchor_counts,
    keep_per_affix,
)


class AttentionDeviationAnchors(AnchorSelector):
    name = "attention-deviation"
    one_pass = OnePass(queries="masks", deviation=True)

    def __init__(self, query: str = "probe") -> None:
        self.attention = AttentionAnchors(query)

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        raise NotImplementedError("attention-deviation scores its attention candidates only: call select()")

    def select(self, ctx: SelectionContext, ratio: float | Sequence[float]) -> torch.Tensor:
        free = anchor_candidates(ctx)
        sizes = affix_sizes(ctx, free)
        counts = anchor_counts(ctx, ratio, self.name)
        mass = self.attention.scores(ctx).float()
        wide = [[min(n, 2 * k) for n, k in zip(row, ks, strict=True)] for row, ks in zip(sizes, counts, strict=True)]
        candidates = keep_per_affix(ctx.affix_slot, mass, free, wide)
        return keep_per_affix(ctx.affix_slot, mass * ctx.stale_deviation(candidates), candidates, counts)
