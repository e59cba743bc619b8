"""The anchor-selector interface: score every affix column, keep the top ``ceil(ratio * n)`` of each affix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from acache.affix.context import SelectionContext


def anchor_count(ratio: float, n: int, selector: str | None = None) -> int:
    """How many of an ``n``-token affix's tokens a request recomputes: none for direct reuse (``none``),
    all for full recompute (``all``), otherwise ``ceil(ratio * n)``, robust to float error (0.3 * 10 is
    3, not 4). The one place this count is defined: selection and page sizing both read it."""
    if selector == "none":
        return 0
    if selector == "all":
        return n
    return min(n, math.ceil(ratio * n - 1e-9))


def keep_most(scores: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` candidates (a ``[T]`` mask) with the highest scores; ties go to the earlier column."""
    order = torch.sort(torch.where(candidates, scores, float("-inf")), descending=True, stable=True).indices
    kept = torch.zeros_like(candidates)
    kept[order[:count]] = True
    return kept & candidates


def affix_sizes(ctx: SelectionContext) -> list[list[int]]:
    """The token count of each affix (slot) of each row."""
    slots = int(ctx.affix_slot.max()) + 1 if ctx.affix_slot.numel() else 0
    return [[int((row == s).sum()) for s in range(slots)] for row in ctx.affix_slot]


def anchor_counts(ctx: SelectionContext, ratio: float | Sequence[float], selector: str) -> list[list[int]]:
    """:func:`anchor_count` of each affix of each row, for ``ratio`` one for the batch or one per row."""
    sizes = affix_sizes(ctx)
    ratios = [ratio] * len(sizes) if isinstance(ratio, (int, float)) else list(ratio)
    return [[anchor_count(r, n, selector) for n in row] for r, row in zip(ratios, sizes, strict=True)]


def keep_per_affix(affix_slot: torch.Tensor, scores: torch.Tensor, candidates: torch.Tensor,
                   counts: list[list[int]]) -> torch.Tensor:
    """``[B, T]``: in each affix ``s`` of each row ``r`` (``affix_slot [B, T]``), the ``counts[r][s]`` candidates
    with the highest scores."""
    kept = torch.zeros_like(candidates)
    for r, row_counts in enumerate(counts):
        for s, count in enumerate(row_counts):
            if count:
                kept[r] |= keep_most(scores[r], candidates[r] & (affix_slot[r] == s), count)
    return kept


def filter_steps(steps: int, depth: float) -> int:
    """How many of the ``steps`` filtering steps (one after each layer from the first stale one) a one-pass
    selection at ``depth`` takes: the first ``ceil(depth * steps)``, at least one."""
    return min(steps, max(1, math.ceil(depth * steps - 1e-9))) if steps > 0 else 0


def carried_counts(k: int, n: int, steps: int, depth: float = 1.0) -> list[int]:
    """How many tokens of an ``n``-token affix are kept after each filtering step (layers 1..L-1), ending at
    ``k``: from ``min(n, 2k)`` down linearly (CacheBlend's gradual filtering), over all ``steps`` at ``depth``
    1, over the first :func:`filter_steps` of them at a lower one (``k`` after those)."""
    active = filter_steps(steps, depth)
    start = min(n, 2 * k)
    if active <= 1:
        return [k] * max(steps, 0)
    head = [round(k + (start - k) * (active - 1 - s) / (active - 1)) for s in range(active)]
    return head + [k] * (steps - active)


@dataclass(frozen=True)
class OnePass:
    """A selector's score inside the refresh (:mod:`acache.affix.one_pass`): ``queries`` (``"masks"`` or
    ``"question"``) scores by the attention mass of those columns on each affix token, summed over the layers so
    far; ``deviation`` by the layer's K/V deviation ``sum_h ||K - K_cached|| + ||V - V_cached||``. With both,
    ``combine`` says how: ``product`` keeps the largest mass times deviation, ``split`` half of the kept by mass
    and the rest by deviation, ``rank`` the best sum of the two ranks (a vote), ``cascade`` the most deviating after
    the first stale layer, then the most attended of them."""

    queries: str | None = None
    deviation: bool = False
    combine: str = "product"

    def __post_init__(self) -> None:
        if self.queries not in (None, "masks", "question"):
            raise ValueError(f"one-pass queries must be 'masks', 'question' or None, got {self.queries!r}")
        if self.queries is None and not self.deviation:
            raise ValueError("a one-pass rule scores by attention mass, deviation or both")
        if self.combine not in ("product", "split", "rank", "cascade"):
            raise ValueError(f"one-pass combine must be product, split, rank or cascade, got {self.combine!r}")


class AnchorSelector:
    """Chooses which affix tokens a request recomputes. Subclasses define :meth:`scores`."""

    name: ClassVar[str]
    #: how the selector scores inside the first refresh (``anchor_pass="one"``); None: it needs a pass of its own
    one_pass: ClassVar[OnePass | None] = None

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        """``[B, T]`` importance of each canvas column; only affix columns are read."""
        raise NotImplementedError

    def select(self, ctx: SelectionContext, ratio: float | Sequence[float]) -> torch.Tensor:
        """Anchor mask ``[B, T]``: in each affix of each row, its :func:`anchor_count` best columns, with
        ``ratio`` one for the batch or one per row."""
        ratios = [ratio] * ctx.affix_slot.shape[0] if isinstance(ratio, (int, float)) else list(ratio)
        scores = self.scores(ctx).float()
        anchors = torch.zeros_like(ctx.affix_mask)
        slot = ctx.affix_slot
        for slot_id in range(int(slot.max()) + 1 if slot.numel() else 0):
            member = slot == slot_id
            counts = member.sum(-1)
            for row in range(slot.shape[0]):
                k = anchor_count(ratios[row], int(counts[row]), self.name)
                if k == 0:
                    continue
                row_scores = torch.where(member[row], scores[row], float("-inf"))
                top = row_scores.topk(k, sorted=False).indices
                anchors[row, top] = True
        return anchors
