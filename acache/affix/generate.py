"""Single-request-path ACache generation: acquire affixes from the store, decode, release."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from acache.affix.policy import AffixDualCache
from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import make_selector
from acache.affix.store import AffixHold, AffixStore
from acache.decoding.generate import GenerationResult, generate
from acache.models.base import DiffusionLM
from acache.sampling_params import SamplingParams


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


def generate_with_affixes(model: DiffusionLM, store: AffixStore, prompts: Sequence[AffixPrompt],
                          params: SamplingParams, stop_token_ids: Sequence[int] = (),
                          generators: list[torch.Generator | None] | None = None
                          ) -> tuple[GenerationResult, list[AffixRequestStats]]:
    """Decodes ``prompts`` reusing their affixes' shared K/V under ``params.affix_policy``."""
    if params.affix_policy is None:
        raise ValueError("generate_with_affixes needs SamplingParams.affix_policy")
    selector = make_selector(params.affix_policy, params.anchor_query)
    holds = [AffixHold(store) for _ in prompts]
    try:
        placements = [[(span.start, hold.acquire(p.affix_ids(span), span.name)) for span in p.affixes]
                      for p, hold in zip(prompts, holds, strict=True)]
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        policy = AffixDualCache(placements, selector, params.anchor_ratio, gen, params.refresh_interval)
        result = generate(model, [p.layout for p in prompts], params, stop_token_ids, generators, policy=policy)
    finally:
        for hold in holds:
            hold.release()
    plan = policy.anchor_plan
    positions = result.canvas.positions
    stats = []
    for row, hold in enumerate(holds):
        anchor_cols = plan.anchors[row].nonzero().flatten()
        stats.append(AffixRequestStats(
            selector=params.affix_policy, anchor_ratio=params.anchor_ratio,
            affix_tokens=int((plan.affix_slot[row] >= 0).sum()),
            anchors=positions[row, anchor_cols].tolist(),
            recomputed_per_refresh=int(plan.recompute[row].sum()),
            refresh_times_s=list(result.stats.refresh_times_s),
            selection_time_s=plan.selection_time_s, affix_hits=hold.hits, affix_misses=hold.misses,
        ))
    return result, stats
