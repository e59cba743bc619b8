"""Affix-isolated attention: the mask under which a training forward computes what direct reuse serves.

Direct reuse computes each affix alone (its tokens attend only to its own tokens) and lets every other token
attend to everything, the affixes' cached K/V included. A forward whose affix queries see only their own
span's keys, and whose other queries see every valid key, therefore gives every token the states direct
reuse gives it: the same affix K/V at every layer and the same logits elsewhere (RoPE makes attention inside
a span depend on relative positions only, so the span computed at its place in the prompt is the span
computed alone). Training on such forwards teaches a model to be reused (Block-Attention's idea, for a
diffusion LM's bidirectional attention).

ACache's refreshes are trained the same way: :func:`with_anchors` gives the refresh with its anchors fixed (the
two-pass form), :func:`with_one_pass_anchors` the first refresh that chooses them inside it (the one-pass form,
whose mask changes at a layer). Each row equals the engine's forward state for state (tests/lab/train). On a
shifted family the column before the generation region is fresh in every refresh, direct reuse included
(:func:`with_fresh_columns`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from acache.affix.context import compact_index
from acache.affix.one_pass import FIRST_STALE

Spans = Sequence[tuple[int, int]]

#: the first layer a one-pass refresh runs as a refresh, the one after the first stale layer
ONE_PASS_SPLIT = FIRST_STALE + 1


def isolation_mask(valid: torch.Tensor, spans: Sequence[Spans]) -> torch.Tensor:
    """``[B, T, T]``: query ``q`` of row ``b`` may attend key ``k`` when ``k`` is valid and, if ``q`` lies in one
    of the row's ``[start, end)`` spans, ``k`` lies in the same span. A row with no spans attends as usual."""
    owner = span_owners(valid, spans)
    same = owner[:, :, None] == owner[:, None, :]
    return valid[:, None, :] & ((owner[:, :, None] == 0) | same)


def span_owners(valid: torch.Tensor, spans: Sequence[Spans]) -> torch.Tensor:
    """``[B, T]``: 0 on a column outside the row's spans, ``n`` on its ``n``-th span's columns."""
    if len(spans) != valid.shape[0]:
        raise ValueError(f"spans are given for {len(spans)} rows of a batch of {valid.shape[0]}")
    b, t = valid.shape
    owner = torch.zeros(b, t, dtype=torch.long, device=valid.device)
    for row, row_spans in enumerate(spans):
        for n, (start, end) in enumerate(row_spans, start=1):
            if not 0 <= start < end <= t:
                raise ValueError(f"span [{start}, {end}) of row {row} is empty or outside its {t} columns")
            if bool((owner[row, start:end] != 0).any()):
                raise ValueError(f"span [{start}, {end}) of row {row} overlaps another")
            owner[row, start:end] = n
    return owner


def with_anchors(ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, spans: Sequence[Spans],
                 anchors: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose forward is ACache's refresh with fixed anchors (the two-pass form): ``ids``, ``positions``,
    ``valid`` ``[B, T + A]`` and the per-query mask ``[B, T + A, T + A]``.

    Each affix token keeps the K/V it has computed alone, as the cache holds it, and every anchor is recomputed in
    context, so an anchor has two K/V: the alone one, which the other tokens of its affix read, and the refreshed
    one, which the request's own tokens and the other anchors read. One column cannot hold both, so each row's
    anchors (``anchors[b]``: columns inside its ``spans``) get a second column after the ``T`` original ones, at
    their own positions, attending as the request's own tokens do; the originals stay in the isolated mask and no
    other column reads them. A row with no anchors is :func:`isolation_mask`'s row, padded."""
    b, t = valid.shape
    owner = span_owners(valid, spans)
    is_anchor = _anchor_columns(anchors, spans, valid)
    cols, copied, _, ext_ids, ext_positions, ext_valid = _copies_after(ids, positions, valid, is_anchor)
    width = cols.shape[1]
    unread = valid & ~is_anchor  # what the request's own columns read of the originals: all but the anchors
    outside = owner == 0  # the request's own columns (and padding, which attends as they do)
    mask = torch.zeros(b, t + width, t + width, dtype=torch.bool, device=valid.device)
    mask[:, :t, :t] = torch.where(outside[:, :, None], unread[:, None, :],
                                  valid[:, None, :] & (owner[:, :, None] == owner[:, None, :]))
    mask[:, :t, t:] = outside[:, :, None] & copied[:, None, :]
    mask[:, t:, :t] = unread[:, None, :].expand(-1, width, -1)  # an unused copy slot too: no row is empty
    mask[:, t:, t:] = copied[:, None, :].expand(-1, width, -1)
    return ext_ids, ext_positions, ext_valid, mask


def with_fresh_columns(ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, spans: Sequence[Spans],
                       fresh: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose forward is direct reuse with some affix columns recomputed in context at their own place:
    ``ids``, ``positions``, ``valid`` ``[B, T + F]`` and the per-query mask ``[B, T + F, T + F]``.

    A shifted family (Dream) reads a column's prediction from the column before it, so the engine recomputes the
    column before the generation region at every refresh even under direct reuse (``RequestState.base_recompute``).
    When an affix ends there, that column (``fresh[b]``: columns inside the row's ``spans``) has two K/V, as an
    anchor has: the fresh one, which the request's own columns read, and the one computed alone, which the rest of
    its affix read when the cache was made. Unlike :func:`with_anchors` the fresh one keeps the column, so that the
    shifted prediction of the next column reads it; the alone one is a copy after the ``T`` columns."""
    b, t = valid.shape
    owner = span_owners(valid, spans)
    is_fresh = _anchor_columns(fresh, spans, valid)
    cols, copied, at, ext_ids, ext_positions, ext_valid = _copies_after(ids, positions, valid, is_fresh)
    width = cols.shape[1]
    copy_owner = torch.where(copied, owner.gather(1, at), -1)
    everything = (owner == 0) | is_fresh  # the request's own columns and the fresh ones: every valid original
    alone = valid & ~is_fresh  # what an affix token reads of its own span's originals
    mask = torch.zeros(b, t + width, t + width, dtype=torch.bool, device=valid.device)
    mask[:, :t, :t] = torch.where(everything[:, :, None], valid[:, None, :],
                                  alone[:, None, :] & (owner[:, :, None] == owner[:, None, :]))
    mask[:, :t, t:] = ~everything[:, :, None] & copied[:, None, :] & (owner[:, :, None] == copy_owner[:, None, :])
    mask[:, t:, :t] = torch.where(copied[:, :, None], alone[:, None, :] & (copy_owner[:, :, None] == owner[:, None, :]),
                                  valid[:, None, :])  # an unused copy slot reads every valid column: no row is empty
    mask[:, t:, t:] = copied[:, :, None] & copied[:, None, :] & (copy_owner[:, :, None] == copy_owner[:, None, :])
    return ext_ids, ext_positions, ext_valid, mask


class LayeredMask(NamedTuple):
    """Per-query masks ``[B, T, T]`` that change at a layer: ``early`` for the layers before ``split``, ``late``
    for the rest. A one-pass refresh attends in context at its first layers and as a refresh after them."""

    early: torch.Tensor
    late: torch.Tensor
    split: int


def with_one_pass_anchors(ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, spans: Sequence[Spans],
                          anchors: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     LayeredMask]:
    """Rows whose forward is ACache's first refresh with its anchors chosen inside it (the one-pass form,
    :mod:`acache.affix.one_pass`), the anchors fixed after the first stale layer: ``ids``, ``positions``, ``valid``
    ``[B, T + N]`` and a :class:`LayeredMask`.

    Up to the first stale layer the one-pass refresh runs every column in context; after it, the request's own
    columns and the anchors attend to each other and to the other affix tokens' K/V as the cache holds them,
    computed alone. So a row with anchors (``anchors[b]``, columns inside its ``spans``) keeps its ``T`` columns
    for the in-context forward and gets a copy of every affix token after them, at its own position, computing
    its affix alone at every layer; from ``split`` on its own columns and anchors read the copies of the affix
    tokens that are not anchors instead of the originals. A row with no anchors attends as
    :func:`isolation_mask`'s row at every layer (its spans computed alone; none given: full attention)."""
    b, t = valid.shape
    owner = span_owners(valid, spans)
    is_anchor = _anchor_columns(anchors, spans, valid)
    anchored = is_anchor.any(1)
    for row, row_anchors in enumerate(anchors):
        bare = [(start, end) for start, end in spans[row] if not any(start <= c < end for c in row_anchors)]
        if row_anchors and bare:  # the engine reads such an affix from the cache at every layer, in context at none
            raise ValueError(f"row {row}'s affix spans {bare} take no anchor: a one-pass row anchors every affix "
                             "of its row")
    # the columns each anchored row copies: all its affix tokens
    cols, copied, at, ext_ids, ext_positions, ext_valid = _copies_after(ids, positions, valid,
                                                                       (owner > 0) & anchored[:, None])
    width = cols.shape[1]
    copy_owner = torch.where(copied, owner.gather(1, at), -1)
    copy_read = copied & ~is_anchor.gather(1, at)  # from split on, the alone K/V of the affix tokens not anchors

    plain = isolation_mask(valid, [() if a else s for s, a in zip(spans, anchored.tolist(), strict=True)])
    early = torch.zeros(b, t + width, t + width, dtype=torch.bool, device=valid.device)
    early[:, :t, :t] = plain  # an anchored row's originals: every valid column in context
    early[:, t:, t:] = copied[:, :, None] & (copy_owner[:, :, None] == copy_owner[:, None, :])
    early[:, t:, :t] = ~copied[:, :, None] & valid[:, None, :]  # an unused copy slot: no row is empty
    late = early.clone()
    refresh = valid & ((owner == 0) | is_anchor)  # the own columns and the anchors, fresh
    late_row = torch.cat((refresh, copy_read), 1)[:, None, :].expand(-1, t, -1)
    late[:, :t] = torch.where(anchored[:, None, None], late_row, early[:, :t])
    return ext_ids, ext_positions, ext_valid, LayeredMask(early, late, ONE_PASS_SPLIT)


def _anchor_columns(anchors: Sequence[Sequence[int]], spans: Sequence[Spans], valid: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: each row's ``anchors``, or a ValueError that names what is wrong with them: a row count other
    than the batch's, or an anchor repeated or outside its row's affix spans."""
    b, t = valid.shape
    if len(anchors) != b:
        raise ValueError(f"anchors are given for {len(anchors)} rows of a batch of {b}")
    is_anchor = torch.zeros(b, t, dtype=torch.bool, device=valid.device)
    for row, (row_anchors, row_spans) in enumerate(zip(anchors, spans, strict=True)):
        inside = [c for c in row_anchors if any(start <= c < end for start, end in row_spans)]
        if len(inside) != len(row_anchors) or len(set(row_anchors)) != len(row_anchors):
            raise ValueError(f"row {row}'s anchors must be distinct columns of its affix spans {list(row_spans)}, "
                             f"not {sorted(row_anchors)}")
        is_anchor[row, list(row_anchors)] = True
    return is_anchor


def _copies_after(ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, copy_of: torch.Tensor,
                  ) -> tuple[torch.Tensor, ...]:
    """The columns ``copy_of [B, T]`` marks, copied after each row's ``T`` at their own positions, in order:
    ``cols [B, W]`` (padded with ``T``), ``copied [B, W]``, ``at`` (``cols`` clamped for gathers), and the
    extended ``ids``, ``positions`` and ``valid`` ``[B, T + W]``."""
    t = valid.shape[1]
    cols, copied = compact_index(copy_of, fill=t)
    at = cols.clamp_max(t - 1)
    ext_ids = torch.cat((ids, torch.where(copied, ids.gather(1, at), 0)), 1)
    ext_positions = torch.cat((positions, torch.where(copied, positions.gather(1, at), 0)), 1)
    return cols, copied, at, ext_ids, ext_positions, torch.cat((valid, copied), 1)
