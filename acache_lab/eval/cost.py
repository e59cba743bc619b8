"""What a policy costs a request, in token-layer passes (one token through one layer), selection included.

Counted for the study's setting: the answer region is one block on the dual cache, so a request runs one
refresh at its block boundary (the recompute set through every layer) and the same in-block steps under
every policy (left out, being equal). Selection is counted from each selector's definition:

* ``attention``, ``query-attention``: the probe, the request's own columns through every layer (``attention``
  with the shallow probe: through its first ``shallow_layers`` only);
* ``attention`` with full queries, ``kv-deviation``: a full forward of the canvas;
* ``attention-deviation``: the probe (or the shallow one), then layers 0 and 1 of the non-affix columns and of
  its ``min(n, 2k)`` candidates an affix;
* ``cacheblend``: layers 0 and 1 of every column, then the request's own columns and the carried affix tokens
  through each later layer;
* ``influence``: the probe, and each affix alone through every layer for its queries (the same for every
  request that shares the affix: stored beside its K/V, they would cost nothing per request and leave the
  probe, as for ``attention``);
* ``first-k``, ``random``, ``none``, ``all``: nothing.

An affix whose cached K/V are exact where it is placed (``exact``: a block-causal model's affix at column 0,
``RequestState.exact_affixes``) takes no anchors short of the whole affix, as the engine serves it, and a one-pass
refresh feeds none of its columns but those it recomputes anyway; a request none of whose affixes takes anchors selects
nothing. A pass of its own still scores such an affix beside an approximate one (its anchors there are dropped after).

The request's own columns are every non-affix column and the ``fresh`` affix columns every refresh recomputes anyway
(:func:`fresh_affix_columns`: an attention block a block-causal model's affix shares with them, the column before a
shifted model's region); anchors are counted among the other affix columns, as the engine chooses them.

A one-pass selector (``anchor_pass="one"``) chooses inside the refresh: nothing is spent before it, and its refresh
runs layers 0 and 1 of every column (but an exact affix's), then the request's own columns and the carried candidates
(from ``min(m, 2k)`` down to ``k``, ``m`` the affix's columns not recomputed anyway) through each later layer, the
pass CacheBlend's selection runs.

BiCache is left out: it recomputes layers, not tokens, and selects nothing.
"""

from __future__ import annotations

import torch

from acache.affix.context import shallow_layers
from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import SELECTORS, placed_anchor_counts
from acache.affix.selectors.base import carried_counts, free_columns
from acache.decoding.request_state import RequestState
from acache.models.config import ModelConfig
from acache.policies import QUERY_SELECTORS
from acache.sampling_params import SamplingParams

#: the selectors that choose from the layout alone, at admission: no selection pass (``AnchorSelector.layout_only``)
FREE = tuple(name for name, selector in SELECTORS.items() if selector.layout_only)


def exact_affixes(config: ModelConfig, prompt: AffixPrompt, gen_length: int) -> list[bool]:
    """Which of ``prompt``'s affixes are exact where they are placed, by the engine's rule
    (``RequestState.exact_affixes``: a block-causal model's affix at column 0)."""
    state, spans = _placed(config, prompt, gen_length, False)
    return state.exact_affixes(spans)


def fresh_affix_columns(config: ModelConfig, prompt: AffixPrompt, gen_length: int, *,
                        shifted: bool) -> list[int]:
    """How many columns of each of ``prompt``'s affixes every refresh recomputes anyway, by the engine's rule
    (``free_columns``: an attention block a block-causal model's affix shares with the request's own columns, the
    column before a ``shifted`` model's region): they are never anchors, and they cost what own columns cost."""
    state, spans = _placed(config, prompt, gen_length, shifted)
    free = free_columns(state, spans)
    return [c1 - c0 - int(free[c0:c1].sum()) for c0, c1 in spans]


def _placed(config: ModelConfig, prompt: AffixPrompt, gen_length: int, shifted: bool,
            ) -> tuple[RequestState, list[tuple[int, int]]]:
    state = RequestState(prompt.layout, SamplingParams(gen_length=gen_length, block_length=gen_length),
                         config.mask_token_id, config.pad_token_id, shifted, torch.device("cpu"),
                         attention_block=config.block_size)
    starts = [state.canvas.column(0, a.start) for a in prompt.affixes]
    return state, [(c0, c0 + a.length) for c0, a in zip(starts, prompt.affixes, strict=True)]


def counts(policy: str, affixes: list[int], ratio: float, exact: list[bool] | None = None,
           fresh: list[int] | None = None) -> list[int]:
    """Each affix's anchor count, as the engine counts it (the affixes laid end to end: only the flags and the
    ``fresh`` counts of :func:`fresh_affix_columns` matter)."""
    spans, start = [], 0
    for n in affixes:
        spans.append((start, start + n))
        start += n
    fresh = fresh or [0] * len(affixes)
    return placed_anchor_counts(ratio, policy, spans, exact or [False] * len(affixes),
                                [n - f for n, f in zip(affixes, fresh, strict=True)])


def selection_passes(policy: str, query: str, canvas: int, affixes: list[int], layers: int, ratio: float,
                     exact: list[bool] | None = None, fresh: list[int] | None = None) -> int:
    """Token-layer passes of choosing the anchors of one request: a ``canvas``-column request whose affixes
    have ``affixes`` tokens each (``fresh`` of them recomputed anyway, :func:`fresh_affix_columns`), on a
    ``layers``-layer model."""
    fresh = fresh or [0] * len(affixes)
    own = canvas - sum(affixes) + sum(fresh)  # the columns the probe feeds, as a refresh does
    ks = counts(policy, affixes, ratio, exact, fresh)
    if policy in FREE or not any(ks):
        return 0
    # from here a pass of its own scores every affix by anchor_count (its anchors in an exact one are dropped after)
    if policy == "influence":
        return own * layers + sum(affixes) * layers
    own_query = policy in QUERY_SELECTORS
    if policy == "kv-deviation" or (own_query and query == "full"):  # a full forward (holds layer 1's K/V too)
        return canvas * layers
    probe = own * (shallow_layers(layers) if own_query and query == "shallow" else layers)
    if policy in ("attention", "query-attention"):
        return probe
    if policy == "attention-deviation":  # its pass scores an exact affix too
        scored = counts(policy, affixes, ratio, None, fresh)
        candidates = sum(min(n - f, 2 * k) for n, f, k in zip(affixes, fresh, scored, strict=True))
        # its layers 0-1 feed the non-affix columns and the candidates (SelectionContext.stale_deviation)
        return probe + (canvas - sum(affixes) + candidates) * min(2, layers)
    if policy == "cacheblend":
        if layers < 2:  # nothing to measure: no forward runs
            return 0
        return filtering_passes(policy, canvas, affixes, layers, ratio, fresh=fresh)
    raise ValueError(f"no cost model for policy {policy!r}")


def filtering_passes(policy: str, canvas: int, affixes: list[int], layers: int, ratio: float,
                     depth: float = 1.0, exact: list[bool] | None = None, fresh: list[int] | None = None) -> int:
    """Layers 0 and 1 of every column (but those of an affix taking no anchors, short of its ``fresh`` ones), then
    the request's own columns and the carried affix tokens through each later layer: CacheBlend's selection, and a
    one-pass selector's whole first refresh (at ``depth``: carried down to the anchors sooner)."""
    fresh = fresh or [0] * len(affixes)
    own = canvas - sum(affixes) + sum(fresh)
    ks = counts(policy, affixes, ratio, exact, fresh)
    plans = [carried_counts(k, n - f, max(layers - 1, 1), depth) for k, n, f in zip(ks, affixes, fresh, strict=True)]
    later = sum(own + sum(plan[layer - 2] for plan in plans) for layer in range(2, layers))
    # an affix taking no anchor stays cached, but for its columns every refresh recomputes anyway
    first = canvas - sum(affixes) + sum(n if k else f for n, k, f in zip(affixes, ks, fresh, strict=True))
    return first * min(2, layers) + later


def refresh_passes(policy: str | None, canvas: int, affixes: list[int], layers: int, ratio: float,
                   exact: list[bool] | None = None, fresh: list[int] | None = None) -> int:
    """Token-layer passes of one refresh: the anchors and the request's own columns (every non-affix column, and
    the ``fresh`` affix columns) through every layer (the whole canvas without the affix cache)."""
    if policy is None:
        return canvas * layers
    fresh = fresh or [0] * len(affixes)
    return (canvas - sum(affixes) + sum(fresh) + sum(counts(policy, affixes, ratio, exact, fresh))) * layers


def request_passes(policy: str | None, query: str, canvas: int, affixes: list[int], layers: int,
                   ratio: float, anchor_pass: str | None = None, anchor_depth: float = 1.0,
                   exact: list[bool] | None = None, fresh: list[int] | None = None) -> int:
    """Selection plus the block-boundary refresh (one pass: the refresh that selects; neither selects where no
    affix takes anchors)."""
    if policy is not None and affixes and not any(counts(policy, affixes, ratio, exact, fresh)):
        return refresh_passes(policy, canvas, affixes, layers, ratio, exact, fresh)
    if anchor_pass == "one":  # at ratio 0 and 1 the one pass is the refresh of direct reuse or full recomputation
        return filtering_passes(policy, canvas, affixes, layers, ratio, anchor_depth, exact, fresh) \
            if 0 < ratio < 1 and layers > 1 else refresh_passes(policy, canvas, affixes, layers, ratio, exact, fresh)
    select = 0 if policy is None else selection_passes(policy, query, canvas, affixes, layers, ratio, exact, fresh)
    return select + refresh_passes(policy, canvas, affixes, layers, ratio, exact, fresh)
