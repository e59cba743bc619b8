"""What the scheduler hands the model runner, what the runner hands back, and what the engine returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from acache.decoding.request_state import StepPlan
from acache.engine.request import Request, RequestMetrics, Status

#: one request's proposed tokens and their confidences ``[L]`` for its current block
Sample = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ForwardBatch:
    """Requests that run one batched forward: all refreshes or all in-block steps; a BiCache refresh
    batch shares one ``split`` layer; a ``select`` batch is of first refreshes that choose their anchors inside
    the forward (``anchor_pass="one"``)."""

    requests: list[Request]
    plans: list[StepPlan]
    refresh: bool
    split: int | None = None
    select: bool = False

    def only(self, requests: list[Request]) -> ForwardBatch:
        """The same forward for some of its requests (to rerun them apart when one of them fails)."""
        keep = {id(r) for r in requests}
        pairs = [(r, p) for r, p in zip(self.requests, self.plans, strict=True) if id(r) in keep]
        return ForwardBatch([r for r, _ in pairs], [p for _, p in pairs], self.refresh, self.split, self.select)


@dataclass
class SchedulerOutput:
    select: list[Request] = field(default_factory=list)  # anchors to choose (BiCache: affix K/V to place)
    forwards: list[ForwardBatch] = field(default_factory=list)
    failed: list[EngineOutput] = field(default_factory=list)  # requests whose admission failed, alone

    def __bool__(self) -> bool:
        return bool(self.select or self.forwards)


@dataclass
class RunnerOutput:
    """Per request id: chosen anchors (canvas columns: by the selection, or by a ``select`` forward), the block's
    proposed tokens and confidences (of a forward, or of the selection probe under ``probe_step``), or the error
    that failed it; with the time of each batched selection and forward."""

    anchors: dict[str, torch.Tensor | None] = field(default_factory=dict)
    samples: dict[str, Sample] = field(default_factory=dict)
    probe_samples: dict[str, Sample] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    selection_time_s: float = 0.0
    forward_times_s: list[float] = field(default_factory=list)  # one per ForwardBatch, in order


@dataclass
class EngineOutput:
    request_id: str
    token_ids: list[int]  # cut at the first stop token; for a partial output, the finished blocks so far
    status: Status
    anchors: list[int]  # absolute positions of the recomputed affix tokens
    affix_tokens: int  # affix tokens the request reused
    recomputed_per_refresh: int
    cached_tokens: int  # of the affix tokens, those read from the shared copy at every refresh (Request.cached_tokens)
    stats: RequestMetrics
    nfe: int = 0
    refreshes: int = 0
    bicache_depth: int | None = None
    finished: bool = True
    stop_token_id: int | None = None  # the stop token that ended the output before gen_length (not in token_ids)
    error: str | None = None  # why the request failed (status FAILED)

    @property
    def stopped(self) -> bool:
        return self.stop_token_id is not None
