"""Single-request-path ACache generation: acquire affixes from the store, decode, release."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from acache.affix.bicache import BiCacheDualCache, BiCacheProfile, matched_depth
from acache.affix.context import request_seed
from acache.affix.policy import AffixDualCache
from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import SELECTORS, make_selector
from acache.affix.store import AffixHold, AffixStore
from acache.decoding.generate import GenerationResult, generate
from acache.models.base import DiffusionLM
from acache.sampling_params import SamplingParams

BICACHE_POLICIES = ("bicache-matched", "bicache-profiled")
AFFIX_POLICIES = (*SELECTORS, *BICACHE_POLICIES)


@dataclass
class AffixRequestStats:
    selector: str
    anchor_ratio: float
    affix_tokens: int
    anchors: list[int]  # absolute positions of the recomputed affix tokens
    recomputed_per_refresh: int  # tokens this request feeds at each refresh
    refresh_times_s: list[float] = field(default_factory=list)  # of the batch's refreshes
    selection_time_s: float = 0.0  # of the batch's anchor selection
    affix_hits: int = 0
    affix_misses: int = 0
    bicache_depth: int | None = None  # deep layers recomputed, for the BiCache policies


def bicache_depths(model: DiffusionLM, prompts: Sequence[AffixPrompt], params: SamplingParams,
                   profile: BiCacheProfile | None) -> list[int]:
    layers = len(model.layers)
    if params.affix_policy == "bicache-matched":
        return [matched_depth(params.anchor_ratio, layers)] * len(prompts)
    if profile is None:
        raise ValueError("affix_policy 'bicache-profiled' needs a BiCache profile: build one with "
                         "`acache bicache-profile` and pass it to LLM(bicache_profile=...)")
    return [profile.depth(sum(a.length for a in p.affixes) / (len(p.token_ids) + params.gen_length))
            for p in prompts]


def generate_with_affixes(model: DiffusionLM, store: AffixStore, prompts: Sequence[AffixPrompt],
                          params: SamplingParams, stop_token_ids: Sequence[int] = (),
                          generators: list[torch.Generator | None] | None = None,
                          bicache_profile: BiCacheProfile | None = None
                          ) -> tuple[GenerationResult, list[AffixRequestStats]]:
    """Decodes ``prompts`` reusing their affixes' shared K/V under ``params.affix_policy``."""
    if params.affix_policy is None:
        raise ValueError("generate_with_affixes needs SamplingParams.affix_policy")
    bicache = params.affix_policy in BICACHE_POLICIES
    depths = bicache_depths(model, prompts, params, bicache_profile) if bicache else None
    selector = None if bicache else make_selector(params.affix_policy, params.anchor_query)
    holds = [AffixHold(store) for _ in prompts]
    try:
        placements = [[(span.start, hold.acquire(p.affix_ids(span), span.name)) for span in p.affixes]
                      for p, hold in zip(prompts, holds, strict=True)]
        if bicache:
            for items in placements:
                for _, entry in items:
                    store.ensure_hidden(entry)
            policy = BiCacheDualCache(placements, depths, params.refresh_interval)
        else:
            seeds = [request_seed(params.seed, p.token_ids) for p in prompts]
            policy = AffixDualCache(placements, selector, params.anchor_ratio, seeds, params.refresh_interval)
        result = generate(model, [p.layout for p in prompts], params, stop_token_ids, generators, policy=policy)
    finally:
        for hold in holds:
            hold.release()
    if bicache:
        anchors, slot, recompute, selection = policy.anchors, policy.affix_slot, policy.recompute, 0.0
    else:
        plan = policy.anchor_plan
        anchors, slot, recompute, selection = plan.anchors, plan.affix_slot, plan.recompute, plan.selection_time_s
    positions = result.canvas.positions
    stats = []
    for row, hold in enumerate(holds):
        stats.append(AffixRequestStats(
            selector=params.affix_policy, anchor_ratio=params.anchor_ratio,
            affix_tokens=int((slot[row] >= 0).sum()),
            anchors=positions[row, anchors[row].nonzero().flatten()].tolist(),
            recomputed_per_refresh=int(recompute[row].sum()),
            refresh_times_s=list(result.stats.refresh_times_s),
            selection_time_s=selection, affix_hits=hold.hits, affix_misses=hold.misses,
            bicache_depth=policy.depth if bicache else None,
        ))
    return result, stats
