"""The anchor-selector interface: score every affix column, keep the top ``ceil(ratio * n)`` of each affix."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from acache.affix.context import SelectionContext


def anchor_count(ratio: float, n: int) -> int:
    """``ceil(ratio * n)``, robust to float error (0.3 * 10 is 3, not 4)."""
    return min(n, math.ceil(ratio * n - 1e-9))


class AnchorSelector:
    """Chooses which affix tokens a request recomputes. Subclasses define :meth:`scores`."""

    name: ClassVar[str]

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        """``[B, T]`` importance of each canvas column; only affix columns are read."""
        raise NotImplementedError

    def select(self, ctx: SelectionContext, ratio: float) -> torch.Tensor:
        """Anchor mask ``[B, T]``: in each affix of each row, its ``ceil(ratio * n)`` best columns."""
        scores = self.scores(ctx).float()
        anchors = torch.zeros_like(ctx.affix_mask)
        slot = ctx.affix_slot
        for slot_id in range(int(slot.max()) + 1 if slot.numel() else 0):
            member = slot == slot_id
            counts = member.sum(-1)
            for row in range(slot.shape[0]):
                k = anchor_count(ratio, int(counts[row]))
                if k == 0:
                    continue
                row_scores = torch.where(member[row], scores[row], float("-inf"))
                top = row_scores.topk(k, sorted=False).indices
                anchors[row, top] = True
        return anchors
