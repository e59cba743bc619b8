"""Executes a scheduler output for a state-cache model (the state-space variant, R2LM).

Both families see no later block and keep the finished ones in a cache of their own (the state-space
variant a state, R2LM attention K/V); both offer ``empty_cache()``, ``extend(tokens, start, cache) ->
(logits, cache)``, ``extend_many(rows, logits=, cache=)`` (the same for several rows at once, either output
skipped when it is not wanted) and ``cache_bytes(cache)``. The request's
:class:`~acache.decoding.request_state.RequestState` decides every step, as for the attention families: with
a cached policy a step feeds the blocks its decoding block touches, against the cache of every column before
them; with ``cache="none"`` the whole canvas runs from an empty cache at every step, the uncached path the
cached one must equal token for token.

Each forward batch is :func:`run_plans` over its requests' plans and their caches in the
:class:`~acache.engine.state_cache_manager.StateCacheManager`: the state-space variant runs a batch's
rows as one forward (states stacked); R2LM, whose caches differ in length, one row at a time. Like the paged
runner it returns proposals and never changes a request; a request whose forward raises fails alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from acache.affix.prompt import AffixPrompt
from acache.decoding.request_state import RequestState, StepPlan
from acache.engine.model_runner import ModelRunner
from acache.engine.outputs import ForwardBatch, RunnerOutput, Sample, SchedulerOutput
from acache.engine.state_cache_manager import BlockCache, StateCacheManager
from acache.models.r2lm import R2LM
from acache.models.ssm import SSMBlockDiffusionLM
from acache.sampling_params import SamplingParams


def run_plans(model: SSMBlockDiffusionLM | R2LM, items: Sequence[tuple[torch.Tensor, StepPlan, BlockCache]]
              ) -> list[torch.Tensor]:
    """The block logits ``[L, V]`` of each ``(tokens, plan, cache)``. A plan reads columns ``[0, P)`` from the
    cache and feeds ``[P, ...)``; each cache is first advanced to ``P`` (in place: all rows through one
    ``extend_many`` where the family runs rows together, one row at a time otherwise, so that only one row's old and
    new cache live at once), then every fed segment runs against its cache, all rows through one ``extend_many``."""
    behind = [(tokens, plan, cache) for tokens, plan, cache in items if len(plan.past) > cache.covered]
    # a family that runs rows one by one advances each cache alone, the old one let go before the next is made
    groups = [[row] for row in behind] if not model.rows_together else [behind] if behind else []
    for group in groups:
        rows = [(tokens[cache.covered:len(plan.past)], cache.covered, cache.value) for tokens, plan, cache in group]
        for (_, plan, cache), (_, value) in zip(group, model.extend_many(rows, logits=False), strict=True):
            cache.value, cache.covered = value, len(plan.past)
    for _, plan, cache in items:
        if len(plan.past) != cache.covered:
            raise RuntimeError(f"the cache covers {cache.covered} columns but the step reads {len(plan.past)}")
    rows = [(tokens[plan.fed], len(plan.past), cache.value if len(plan.past) else model.empty_cache())
            for tokens, plan, cache in items]
    return [logits[plan.block] for (_, plan, _), (logits, _) in zip(items, model.extend_many(rows, cache=False),
                                                                     strict=True)]


def new_state(model: SSMBlockDiffusionLM | R2LM, prompt: AffixPrompt, params: SamplingParams,
              stop_token_ids: set[int] | frozenset[int]) -> RequestState:
    """A request's decoding state for a state-cache model (no affix is shared: every column is its own)."""
    cfg = model.config
    state = RequestState(prompt.layout, params, cfg.mask_token_id, cfg.pad_token_id, model.shifted_logits,
                         model.device, stop_token_ids, cfg.block_size, state_cache=True)
    state.admit()
    return state


class StateRunner:
    def __init__(self, model: SSMBlockDiffusionLM | R2LM, caches: StateCacheManager) -> None:
        self.model = model
        self.caches = caches
        self.device = model.device

    def release(self, request_id: str) -> None:
        """Nothing is kept for a request outside its state cache (freed by the cache manager)."""

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        for req in sched.select:  # nothing is shared, so no request should ever need a selection
            out.errors[req.request_id] = f"the {self.model.family} family has no affix anchors to select"
        ModelRunner.run_forwards(sched, out, self._forward, self.device)
        return out

    def _forward(self, batch: ForwardBatch) -> dict[str, Sample]:
        items = [(req.state.tokens, plan, self.caches.cache(req)) for req, plan in zip(batch.requests, batch.plans,
                                                                                        strict=True)]
        logits = run_plans(self.model, items)
        return {req.request_id: ModelRunner._propose(req, block[None]) for req, block in zip(batch.requests, logits,
                                                                                          strict=True)}
