"""The anchor-selector interface: score every affix column, keep the top ``ceil(ratio * n)`` of each affix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from acache.affix.context import SelectionContext, request_seed

if TYPE_CHECKING:
    from acache.decoding.request_state import RequestState


def anchor_count(ratio: float, n: int, selector: str | None = None) -> int:
    """How many of an ``n``-token affix's tokens a request recomputes: none for direct reuse (``none``),
    all for full recompute (``all``), otherwise ``ceil(ratio * n)``, robust to float error (0.3 * 10 is
    3, not 4). The one place this count is defined: :func:`placed_anchor_counts` (page sizing, the one-pass
    refresh, admission) and :func:`anchor_counts` (a pass of its own) read it, each capped at the affix's
    columns that are not recomputed anyway."""
    if selector == "none":
        return 0
    if selector == "all":
        return n
    return min(n, math.ceil(ratio * n * (1 - 1e-12)))


def placed_anchor_counts(ratio: float, selector: str | None, spans: Sequence[tuple[int, int]],
                         exact: Sequence[bool], free: Sequence[int] | None = None) -> list[int]:
    """The anchor count of each of a request's affixes at canvas columns ``[c0, c1)``: :func:`anchor_count`, but
    none short of the whole affix where its cached K/V are exact where it is placed (``exact``, from
    ``RequestState.exact_affixes``: a block-causal model's affix at column 0), since anchors there would recompute
    what the cache holds. The whole affix (``all``, ratio 1) is still recomputed: it is the reference decoding; a
    ratio under 1 whose count rounds up to the whole affix is not that, and takes none.
    At most ``free[i]`` of affix ``i``: anchors are chosen among the columns a refresh would otherwise read from
    the cache, not those it recomputes anyway (:func:`free_columns`)."""
    counts = []
    for i, ((c0, c1), is_exact) in enumerate(zip(spans, exact, strict=True)):
        k = anchor_count(ratio, c1 - c0, selector)
        k = 0 if is_exact and not (selector == "all" or ratio >= 1) else k
        counts.append(k if free is None else min(k, free[i]))
    return counts


def free_columns(state: RequestState, spans: Sequence[tuple[int, int]],
                 device: torch.device | None = None) -> torch.Tensor:
    """``[T]``: the columns of the shared affixes at ``spans`` that a refresh reads from the cache unless they are
    anchors: not those it recomputes anyway (``RequestState.base_recompute``: on a block-causal model an attention
    block an affix shares with the request's own columns, on a shifted one the column before the region). Anchors
    are chosen among these alone, so none is spent on a column that is fresh already. Made on ``device`` (default:
    the request's), from host values alone: a mask made on the host is counted without a device read."""
    shared = state.span_mask(spans, device)
    return shared & ~state.base_recompute(shared)


def request_anchor_counts(state: RequestState, spans: Sequence[tuple[int, int]]) -> list[int]:
    """:func:`placed_anchor_counts` of a request's shared affixes at ``spans``, by its parameters and placement (its
    free columns counted on the host: no device read, at admission or in a selecting refresh)."""
    p = state.params
    free = free_columns(state, spans, torch.device("cpu"))
    return placed_anchor_counts(p.anchor_ratio, p.selector, spans, state.exact_affixes(list(spans)),
                                [int(free[c0:c1].sum()) for c0, c1 in spans])


def top_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` highest of ``scores [T]``, ties to the earlier column: one rule for a canvas row and
    a request's own columns, so both choose the same anchors however the row is padded (``topk`` leaves ties to
    the layout of its input)."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


def admission_anchors(selector: AnchorSelector, state: RequestState, spans: Sequence[tuple[int, int]],
                      counts: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor | None:
    """``[T]``: the anchors a request with shared affixes at ``spans`` (their ``counts``,
    :func:`request_anchor_counts`) takes when it is admitted, or None when a forward chooses them (a selection
    step, or the first refresh). None are taken where no affix takes any (direct reuse, ratio 0, exact affixes);
    a :attr:`~AnchorSelector.layout_only` selector's are, in each affix, the ``counts`` columns of highest
    :meth:`~AnchorSelector.row_scores` (from the request's own seed, ``request_seed`` of its ``token_ids``), which
    :meth:`~AnchorSelector.select` chooses on a canvas. A ``probe_step`` request runs its probe all the same: the probe
    decodes its first step."""
    if state.params.probe_step:
        return None
    anchors = torch.zeros(state.length, dtype=torch.bool, device=state.tokens.device)
    if not any(counts):
        return anchors
    if not selector.layout_only:
        return None
    scores = selector.row_scores(state.canvas.valid[0] & ~state.far_columns(),
                                 request_seed(state.params.seed, token_ids))
    scores = torch.where(free_columns(state, spans), scores, float("-inf"))  # counts are at most the free columns
    for (c0, c1), k in zip(spans, counts, strict=True):
        if k:
            anchors[c0 + top_columns(scores[c0:c1], k)] = True
    return anchors


def drop_uncounted(anchors: torch.Tensor, spans: Sequence[tuple[int, int]], counts: Sequence[int]) -> torch.Tensor:
    """``anchors [T]`` a selection of its own chose, without those in the affixes whose count is zero (an exact
    affix's, :func:`placed_anchor_counts`): a pass of its own counts every affix by :func:`anchor_counts`, which
    knows nothing of exactness."""
    if all(counts):
        return anchors
    anchors = anchors.clone()
    for (c0, c1), k in zip(spans, counts, strict=True):
        if k == 0:
            anchors[c0:c1] = False
    return anchors


def affix_sizes(ctx: SelectionContext, within: torch.Tensor | None = None) -> list[list[int]]:
    """The token count of each affix (slot) of each row (``within``: of those columns only)."""
    slots = int(ctx.affix_slot.max()) + 1 if ctx.affix_slot.numel() else 0
    slot = ctx.affix_slot if within is None else torch.where(within, ctx.affix_slot, -1)
    return [[int((row == s).sum()) for s in range(slots)] for row in slot]


def anchor_candidates(ctx: SelectionContext) -> torch.Tensor:
    """``[B, T]``: the affix columns anchors are chosen from, those a refresh would otherwise read from the cache
    (not ``ctx.own``, the columns it recomputes anyway; :func:`free_columns` on one request)."""
    candidates = ctx.affix_mask & ctx.canvas.valid
    return candidates if ctx.own is None else candidates & ~ctx.own


def anchor_counts(ctx: SelectionContext, ratio: float | Sequence[float], selector: str) -> list[list[int]]:
    """:func:`anchor_count` of each affix of each row, for ``ratio`` one for the batch or one per row, at most its
    :func:`anchor_candidates`."""
    sizes, free = affix_sizes(ctx), affix_sizes(ctx, anchor_candidates(ctx))
    ratios = [ratio] * len(sizes) if isinstance(ratio, (int, float)) else list(ratio)
    return [[min(anchor_count(r, n, selector), m) for n, m in zip(row, row_free, strict=True)]
            for r, row, row_free in zip(ratios, sizes, free, strict=True)]


def ranks_per_affix(affix_slot: torch.Tensor, scores: torch.Tensor, candidates: torch.Tensor,
                    slots: int) -> torch.Tensor:
    """``[B, T]`` long: each candidate's rank by ``scores`` among the candidates of its affix (``affix_slot [B, T]``,
    ``slots`` affixes at most a row), 0 the highest and ties to the earlier column; -1 off the candidates (and on
    columns of no affix or of an affix past ``slots``). One sort of every row at once: no loop over requests or
    affixes, and no read of a device value."""
    if slots == 0:
        return torch.full_like(affix_slot, -1)
    candidates = candidates & ((affix_slot == 0) if slots == 1 else (affix_slot >= 0) & (affix_slot < slots))
    order = torch.sort(torch.where(candidates, scores, float("-inf")), dim=-1, descending=True, stable=True).indices
    member = candidates.gather(1, order)
    if slots == 1:  # one affix a row (the common case): the running count of the candidates alone, half the work
        ranked = torch.where(member, member.cumsum(1) - 1, -1)
        return torch.empty_like(ranked).scatter_(1, order, ranked)
    slot = affix_slot.gather(1, order).clamp(0, max(slots - 1, 0))
    # a running count of each affix's candidates along the sorted row: the count before a column is its rank
    seen = ((slot[..., None] == torch.arange(slots, device=slot.device)) & member[..., None]).cumsum(1)
    ranked = torch.where(member, seen.gather(2, slot[..., None]).squeeze(-1) - 1, -1)
    return torch.empty_like(ranked).scatter_(1, order, ranked)


def keep_per_affix(affix_slot: torch.Tensor, scores: torch.Tensor, candidates: torch.Tensor,
                   counts: list[list[int]] | torch.Tensor) -> torch.Tensor:
    """``[B, T]``: in each affix ``s`` of each row ``r`` (``affix_slot [B, T]``), the ``counts[r][s]`` candidates
    with the highest scores (ties to the earlier column). ``counts`` may be given as a ``[B, S]`` tensor on the
    scores' device, so a caller filtering layer after layer builds it once."""
    if not isinstance(counts, torch.Tensor):
        counts = count_tensor(counts, candidates.device)
    slots = counts.shape[1]
    if slots == 0:
        return torch.zeros_like(candidates)
    ranks = ranks_per_affix(affix_slot, scores, candidates, slots)
    if slots == 1:  # -1 off the candidates: below any count, and no per-column gather of the counts
        return (ranks >= 0) & (ranks < counts)
    return (ranks >= 0) & (ranks < counts.gather(1, affix_slot.clamp(0, slots - 1)))


def count_tensor(counts: list[list[int]], device: torch.device) -> torch.Tensor:
    """``counts[r][s]`` as a ``[B, S]`` long tensor, rows padded with 0 to the most affixes of any row."""
    slots = max((len(row) for row in counts), default=0)
    return torch.tensor([row + [0] * (slots - len(row)) for row in counts], dtype=torch.long,
                        device=device).reshape(len(counts), slots)


def plan_tensor(plans: list[list[list[int]]], steps: int, device: torch.device) -> torch.Tensor:
    """Gradual filtering's plans (``plans[r][s]``: :func:`carried_counts` of affix ``s`` of row ``r``) as one
    ``[steps, B, S]`` tensor, made once so a filtering step reads its counts with no copy to the device."""
    slots = max((len(row) for row in plans), default=0)
    return torch.tensor([[[p[step] for p in row] + [0] * (slots - len(row)) for row in plans] for step in range(steps)],
                        dtype=torch.long, device=device).reshape(steps, len(plans), slots)


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
    #: how the selector scores inside the first refresh (``anchor_pass="one"``); None: it needs a pass of its own,
    #: or none at all (:attr:`layout_only`)
    one_pass: ClassVar[OnePass | None] = None
    #: it scores a request's columns from their places and its seed alone (:meth:`row_scores`), with no forward
    #: and no cached K/V: the engine and the reference path choose its anchors when the request is admitted
    #: (:func:`admission_anchors`), with no selection step
    layout_only: ClassVar[bool] = False

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        """``[B, T]`` importance of each canvas column; only affix columns are read. A :attr:`layout_only` selector's
        are its :meth:`row_scores`, row by row, from each request's seed."""
        if not self.layout_only:
            raise NotImplementedError
        valid = ctx.canvas.valid
        seeds = ctx.row_seeds or [0] * valid.shape[0]
        return torch.stack([self.row_scores(row, seed) for row, seed in zip(valid, seeds, strict=True)])

    def row_scores(self, valid: torch.Tensor, seed: int) -> torch.Tensor:
        """A :attr:`layout_only` selector's ``[T]`` scores of one request's columns in order (``valid``: those a
        forward may read, far masks out) from the request's own seed; :meth:`scores` is them row by row."""
        raise NotImplementedError(f"anchor selector {self.name!r} scores with a forward, not from the layout alone")

    def select(self, ctx: SelectionContext, ratio: float | Sequence[float]) -> torch.Tensor:
        """Anchor mask ``[B, T]``: in each affix of each row, its :func:`anchor_count` best columns of its
        :func:`anchor_candidates`, with ``ratio`` one for the batch or one per row."""
        scores = torch.where(anchor_candidates(ctx), self.scores(ctx).float(), float("-inf"))
        anchors = torch.zeros_like(ctx.affix_mask)
        for row, row_counts in enumerate(anchor_counts(ctx, ratio, self.name)):
            for slot_id, k in enumerate(row_counts):
                if k:
                    member = ctx.affix_slot[row] == slot_id
                    anchors[row, top_columns(torch.where(member, scores[row], float("-inf")), k)] = True
        return anchors
