"""The project's own selector: the affix tokens whose staleness the masks would read most.

A stale cached token ``j`` perturbs what a mask position reads by about its attention weight times how far
its K/V are from their in-context values. So the score is ``I(j) * D(j)``: ACache's attention mass of the
masks on ``j`` (the serving-path probe, DESIGN §4.3) times ``j``'s K/V deviation at layer 1, the first
layer that goes stale (CacheBlend's measure, from layers 0 and 1 of the canvas in full context). Attention
alone keeps tokens that are read but barely stale; deviation alone keeps tokens that are stale but unread.
"""

from __future__ import annotations

import torch

from acache.affix.context import SelectionContext
from acache.affix.selectors.attention import AttentionAnchors
from acache.affix.selectors.base import AnchorSelector


class AttentionDeviationAnchors(AnchorSelector):
    name = "attention-deviation"

    def __init__(self, query: str = "probe") -> None:
        self.attention = AttentionAnchors(query)

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        return self.attention.scores(ctx) * ctx.first_stale_deviation()
