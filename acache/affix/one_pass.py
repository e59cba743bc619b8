"""Anchors chosen inside the request's first refresh forward (``anchor_pass="one"``): selection adds no forward.

The first refresh of a request with shared affixes runs layer by layer:

* layers 0 and 1 (up to the first stale one: layer 0's K/V depend on each token alone) on every column in
  context, affix tokens included (but those of an affix that takes no anchors), as CacheBlend's first layers run;
* from layer 2 on, only the request's own columns (the ones every refresh recomputes) and the carried
  candidates, against the cached K/V of the other affix tokens; after each layer from 1 on, the candidates
  of each affix are filtered by the selector's score, from ``min(m, 2k)`` after layer 1 down linearly to
  ``k = ceil(ratio * n)`` after the last, and the ``k`` left are the anchors (none on an affix whose cached K/V
  are exact where it is placed, short of the whole affix: ``placed_anchor_counts``). The candidates are the
  ``m`` affix columns that are not the request's own (on a block-causal model an attention block the affix
  shares with them is: ``free_columns``), and ``k`` is at most ``m``;
* at ``anchor_depth`` d < 1 the filtering reaches ``k`` after the first ``ceil(d * (L - 1))`` of those layers
  instead, and the layers after it run the own columns and the anchors alone, in one call, with no score.

Every K/V the forward computes for the own columns and the anchors is kept (the executor writes them where a
refresh writes them: the request's private slots), its final states decode the block's first step, and the
later refreshes recompute the own columns and the anchors as any refresh does. A row whose affixes take no
anchors (ratio 0, or exact affixes) feeds its own columns alone at every layer: direct reuse, the same forward (the
engine does not send such a request here: it has nothing to choose). A row whose
affixes are all anchors (ratio 1) feeds every column at every layer: full recomputation.

Each one-pass selector is a :class:`OnePass` rule (``AnchorSelector.one_pass``): the score at layer ``l`` is
the attention mass of the masks (or of the question) on each affix token summed over layers ``0..l``, or the
layer's K/V deviation ``sum_h ||K - K_cached|| + ||V - V_cached||``, or their product.

Where it differs from the selection of its own (``anchor_pass="two"``):

* the first refresh is not the two-pass refresh: its own columns and anchors attend, at the early layers, to
  fresh K/V of more affix tokens than the anchors (all of them at layers 0-1, the carried ones later), so
  they are nearer full recomputation than that refresh's; from the second refresh on both compute the same;
* ``attention`` and ``query-attention`` score with the queries of this forward (in context at layers 0-1,
  then against fresh carried and cached other keys) over the keys it attends to, instead of the probe's
  queries over the cached keys at every layer, and filter gradually instead of taking the top ``k`` once;
* ``attention-deviation`` filters every layer by mass times that layer's deviation instead of taking the
  masks' top ``2k`` then the top ``k`` by mass times the layer-1 deviation;
* ``cacheblend`` chooses the same anchors: its published selection is this forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from acache.affix.context import AffixMass, compact_index, compact_keys, kv_deviation, visible_keys
from acache.affix.selectors import SELECTORS, request_anchor_counts
from acache.affix.selectors.base import (
    OnePass,
    carried_counts,
    count_tensor,
    filter_steps,
    keep_per_affix,
    plan_tensor,
    ranks_per_affix,
)
from acache.decoding.request_state import RequestState
from acache.models.base import DiffusionLM
from acache.models.kv import LayerView, LayerwiseKV

#: the first layer whose K/V depend on context: the forward runs every column through it before filtering
FIRST_STALE = 1

#: ``cached(layer, cols [B, C])`` -> the cached affix ``(keys, values)`` ``[B, C, Hkv, D]`` at those canvas columns
CachedKV = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class OnePassResult:
    """The selecting refresh's output: final (normed) states in canvas layout ``[B, T, hidden]`` (read at the own
    columns), the anchors ``[B, T]``, and the K/V to keep: per layer ``[B, R, Hkv, D]`` at ``cols [B, R]`` (the
    own columns and the anchors, ascending, padded with ``T``) where ``valid``."""

    hidden: torch.Tensor
    anchors: torch.Tensor
    cols: torch.Tensor
    valid: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class SelectingInputs(NamedTuple):
    """:func:`refresh_selecting`'s arguments before ``cached``, in its order (so ``*inputs`` passes them)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    own: torch.Tensor
    affix_slot: torch.Tensor
    gen: torch.Tensor
    rules: list[OnePass]
    counts: list[list[int]]
    depths: list[float]


def selecting_inputs(rows: list[tuple[RequestState, list[tuple[int, int]]]], device: torch.device,
                     ) -> SelectingInputs:
    """The selecting refresh's inputs for requests about to run it:
    each row is a request's state and the canvas columns ``[c0, c1)`` of its shared affixes, in order. Canvases
    are padded on the right to the longest; the columns fed are the refresh plan's (far masks out)."""
    width, b = max(state.length for state, _ in rows), len(rows)
    tokens = torch.stack([F.pad(state.tokens, (0, width - state.length)) for state, _ in rows])
    positions = torch.stack([F.pad(state.positions, (0, width - state.length)) for state, _ in rows])
    valid = torch.zeros(b, width, dtype=torch.bool, device=device)
    own, gen = torch.zeros_like(valid), torch.zeros_like(valid)
    affix_slot = torch.full((b, width), -1, dtype=torch.long, device=device)
    for i, (state, spans) in enumerate(rows):
        valid[i, state.plan().fed] = True
        for a, (c0, c1) in enumerate(spans):
            affix_slot[i, c0:c1] = a
        own[i, :state.length] = state.base_recompute(state.span_mask(spans, device))
        gen[i, state.gen_start:state.gen_start + state.params.gen_length] = True
    rules = [SELECTORS[state.params.selector].one_pass for state, _ in rows]
    counts = [request_anchor_counts(state, spans) for state, spans in rows]
    depths = [state.params.resolved_anchor_depth for state, _ in rows]
    return SelectingInputs(tokens, positions, valid, own, affix_slot, gen, rules, counts, depths)


def refresh_selecting(model: DiffusionLM, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                      own: torch.Tensor, affix_slot: torch.Tensor, gen: torch.Tensor, rules: list[OnePass],
                      counts: list[list[int]], depths: list[float], cached: CachedKV) -> OnePassResult:
    """The first refresh with its anchors chosen inside it (module docstring).

    ``tokens``/``positions``/``valid`` ``[B, T]``: the canvas and the columns this forward covers (far masks
    out); ``own``: the columns every refresh recomputes; ``affix_slot``: each shared affix column's affix in
    its row (-1 elsewhere); ``gen``: the masked generation columns; ``rules[r]`` and ``counts[r][s]`` (the
    anchor count of affix ``s``) and ``depths[r]`` (its ``anchor_depth``) per row; ``cached`` reads the shared
    affixes' cached K/V."""
    b, t = tokens.shape
    cfg = model.config
    layers, width, dev = cfg.num_layers, cfg.hidden_size, tokens.device
    affix = (affix_slot >= 0) & valid
    sort_keys = compact_keys(b, t, dev)  # every mask compacted below is [B, T]
    # each row's own affixes: a row with one affix batches beside a row with two
    slots = max((len(row_k) for row_k in counts), default=0)
    k0 = count_tensor(counts, dev)  # [B, S]
    member = affix_slot[..., None] == torch.arange(slots, device=dev)
    # the columns each affix's anchors are chosen from: not those every refresh recomputes anyway (own)
    free = (member & ~own[..., None]).sum(1).tolist()  # one read
    sizes = [row[:len(row_k)] for row, row_k in zip(free, counts, strict=True)]
    steps = max(layers - FIRST_STALE, 1)
    plans = [[carried_counts(k, n, steps, depth) for k, n in zip(row_k, row_n, strict=True)]
             for row_k, row_n, depth in zip(counts, sizes, depths, strict=True)]
    # the counts each rule keeps after each filtering step, [steps, B, S] (zero on the other rules' rows): built
    # once, read a step at a time
    carried = plan_tensor(plans, steps, dev)
    by_rule = {rule: carried * torch.tensor([r == rule for r in rules], device=dev)[None, :, None]
               for rule in set(rules)}
    # affix columns whose affix takes anchors
    takes = (member & (k0[:, None, :] > 0)).any(-1)
    cand = affix & takes & ~own
    row_filters = [any(0 < k < n for k, n in zip(row_k, row_n, strict=True))
                   for row_k, row_n in zip(counts, sizes, strict=True)]
    filtering = any(row_filters)

    # the score's terms, decided once: whether any row reads the deviation, which queries count for the mass
    by_dev = any(rule.deviation for rule in rules)
    masks = torch.tensor([rule.queries == "masks" for rule in rules], device=dev)[:, None]
    question = torch.tensor([rule.queries == "question" for rule in rules], device=dev)[:, None]
    weight = valid & ((masks & gen) | (question & own & ~gen & ~affix))
    mass = None
    if filtering and bool(weight.any()) and bool(affix.any()):
        q_cols, q_valid = compact_index(weight, fill=t, keys=sort_keys)
        k_cols, k_valid = compact_index(affix, fill=t, keys=sort_keys)
        k_slot = torch.where(k_valid, affix_slot.gather(1, k_cols.clamp_max(t - 1)), -1)
        mass = AffixMass(cfg, q_valid, k_slot, visible_keys(cfg, positions.gather(1, q_cols.clamp_max(t - 1)),
                                                            positions.gather(1, k_cols.clamp_max(t - 1))))
    mass_sum = torch.zeros(b, t + 1, dtype=torch.float32, device=dev)
    no_deviation = torch.zeros_like(mass_sum)  # a layer with no deviation scored: one zero buffer, never written

    hidden = F.pad(model.embed(tokens), (0, 0, 0, 1))  # a trash column t for padded writes
    saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    # the layers run together until the candidates are next filtered (all of them when nothing is filtered), and
    # those after the last filtering step of the deepest row that filters (layer ``stop - 1``) in one call, with no
    # score: a batch scores as deep as its deepest row
    first = min(FIRST_STALE + 1, layers) if filtering else layers
    stop = min(FIRST_STALE + max(filter_steps(steps, d) for d, f in zip(depths, row_filters, strict=True) if f),
               layers) if filtering else layers
    spans = [range(0, first), *(range(layer, layer + 1) for layer in range(first, stop))]
    if stop < layers:  # stop >= first: filtering starts after layer 1, and nothing filtered runs them all at once
        spans.append(range(stop, layers))
    for span in spans:
        scoring = filtering and span.start < stop
        own_or_cand = own | cand
        fed_mask, past_mask = valid & own_or_cand, affix & ~own_or_cand
        # the three widths this span needs, in one read of the device
        fed_width, past_width, cand_width = torch.stack((fed_mask, past_mask, cand)).sum(-1).amax(-1).tolist()
        fed, fed_valid = compact_index(fed_mask, fill=t, width=fed_width, keys=sort_keys)
        past, past_valid = compact_index(past_mask, fill=t, width=past_width, keys=sort_keys)
        at = fed.clamp_max(t - 1)
        kv = None
        if past.shape[1]:
            at_past = past.clamp_max(t - 1)
            kv = LayerwiseKV(*_layer_views(cached, at_past, layers), positions.gather(1, at_past), past_valid)
        out = model.run_layers(hidden.gather(1, at[..., None].expand(-1, -1, width)), positions.gather(1, at),
                               fed_valid, kv, span, return_kv=True,
                               capture_rotated=scoring and mass is not None)
        hidden.scatter_(1, fed[..., None].expand(-1, -1, width), out.hidden)
        saved += [(fed, keys, values) for keys, values in zip(out.kv.keys, out.kv.values, strict=True)]
        if not scoring:
            continue
        if mass is not None:
            # the scored queries and affix keys, read from the rotated tensors the layer's attention read: an affix
            # key is the fed one (fresh) where its column was fed, else the cached one it attended (the past's)
            q_at, k_at = _index_in(fed, q_cols), _index_in(fed, k_cols)
            is_fed = fed.gather(1, k_at) == k_cols
            key_at = k_at + past.shape[1]
            if past.shape[1]:
                key_at = torch.where(is_fed, key_at, _index_in(past, k_cols))
            for q_rotated, keys_rotated in out.rotated:
                q = q_rotated.gather(1, q_at[..., None, None].expand(-1, -1, *q_rotated.shape[2:]))
                attended = keys_rotated.gather(1, key_at[..., None, None].expand(-1, -1, *keys_rotated.shape[2:]))
                mass_sum.scatter_add_(1, k_cols, model.reduce_heads(mass(q, attended) * k_valid))
        layer = span[-1]
        deviation = no_deviation
        if by_dev and layer >= FIRST_STALE:  # a one-layer model's K/V are context-free: no deviation
            deviation = torch.zeros(b, t + 1, dtype=torch.float32, device=dev)
            # only the candidates' deviation is read
            scored, _ = compact_index(cand, fill=t, width=cand_width, keys=sort_keys)
            at_scored = scored.clamp_max(t - 1)
            index = _index_in(fed, scored)[..., None, None].expand(-1, -1, *out.kv.keys[-1].shape[2:])
            stale_keys, stale_values = cached(layer, at_scored)
            deviation.scatter_(1, scored, model.reduce_heads(kv_deviation(
                out.kv.keys[-1].gather(1, index), out.kv.values[-1].gather(1, index), stale_keys, stale_values)))
        step = max(layer - FIRST_STALE, 0)
        cand = _filter(affix_slot, cand, mass_sum[:, :t], deviation[:, :t], {r: c[step] for r, c in by_rule.items()},
                       step)

    kept, kept_valid = compact_index(valid & (own | cand), fill=t, keys=sort_keys)
    out_keys, out_values = [], []
    for fed, keys, values in saved:
        index = _index_in(fed, kept)[..., None, None].expand(-1, -1, *keys.shape[2:])
        out_keys.append(keys.gather(1, index))
        out_values.append(values.gather(1, index))
    return OnePassResult(model.norm(hidden[:, :t]), cand, kept, kept_valid, out_keys, out_values)


def _filter(affix_slot: torch.Tensor, cand: torch.Tensor, mass: torch.Tensor, deviation: torch.Tensor,
            counts: dict[OnePass, torch.Tensor], step: int) -> torch.Tensor:
    """The candidates kept after filtering step ``step`` (0: after the first stale layer): ``counts[rule] [B, S]`` of
    each affix (zero on the rows of other rules), each row by its rule's score."""
    kept = torch.zeros_like(cand)
    for rule, mine in counts.items():
        slots = mine.shape[1]
        by_mass, by_dev = rule.queries is not None, rule.deviation
        if not (by_mass and by_dev):
            kept |= keep_per_affix(affix_slot, mass if by_mass else deviation, cand, mine)
        elif rule.combine == "cascade":  # the stale ones first, then those of them the queries read
            kept |= keep_per_affix(affix_slot, deviation if step == 0 else mass, cand, mine)
        elif rule.combine == "product":
            kept |= keep_per_affix(affix_slot, mass * deviation, cand, mine)
        elif rule.combine == "split":
            half = (mine + 1) // 2
            first = keep_per_affix(affix_slot, mass, cand, half)
            kept |= first | keep_per_affix(affix_slot, deviation, cand & ~first, mine - half)
        else:  # rank: the best sum of the two ranks among the affix's candidates
            ranks = ranks_per_affix(affix_slot, mass, cand, slots) + ranks_per_affix(affix_slot, deviation, cand, slots)
            kept |= keep_per_affix(affix_slot, -ranks.float(), cand, mine)
    return kept


def _index_in(fed: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Where each of ``cols [B, C]`` sits in the ascending ``fed [B, F]`` (clamped: a column not fed lands
    anywhere, and callers check it)."""
    return torch.searchsorted(fed, cols.contiguous()).clamp_max(fed.shape[1] - 1)


def _layer_views(cached: CachedKV, cols: torch.Tensor, layers: int) -> tuple[LayerView, LayerView]:
    """The cached K/V at ``cols`` as a forward reads them, layer by layer: keys, then values of the same layer,
    each layer gathered once."""
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer_kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in memo:
            memo.clear()
            memo[layer] = cached(layer, cols)
        return memo[layer]

    return LayerView(lambda i: layer_kv(i)[0], layers), LayerView(lambda i: layer_kv(i)[1], layers)
