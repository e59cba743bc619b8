"""Executes a scheduler output for a state-cache model (the state-space variant, R2LM).

Each forward batch is :func:`~acache.decoding.blockwise.run_plans` over its requests' plans and their caches
in the :class:`~acache.engine.state_cache_manager.StateCacheManager`: the state-space variant runs a batch's
rows as one forward (states stacked); R2LM, whose caches differ in length, one row at a time. Like the paged
runner it returns proposals and never changes a request; a request whose forward raises fails alone.
"""

from __future__ import annotations

import torch

from acache.decoding.blockwise import run_plans
from acache.engine.model_runner import ModelRunner
from acache.engine.outputs import ForwardBatch, RunnerOutput, Sample, SchedulerOutput
from acache.engine.state_cache_manager import StateCacheManager
from acache.models.r2lm import R2LM
from acache.models.ssm import SSMBlockDiffusionLM


class StateRunner:
    def __init__(self, model: SSMBlockDiffusionLM | R2LM, caches: StateCacheManager) -> None:
        self.model = model
        self.caches = caches
        self.device = model.device

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
