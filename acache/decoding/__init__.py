"""Diffusion decoding: commit rules, the sampler and the one per-request decoding state machine."""

from acache.decoding.commit import CommitRule, Factor, LowConfidence, Threshold, make_commit_rule
from acache.decoding.request_state import Phase, RequestState, StepPlan, truncate_at_stop

__all__ = [
    "CommitRule", "Factor", "LowConfidence", "Phase", "RequestState", "StepPlan", "Threshold", "make_commit_rule",
    "truncate_at_stop",
]
