"""What a request returns."""

from __future__ import annotations

from dataclasses import dataclass

from acache.affix.generate import AffixRequestStats


@dataclass
class RequestStats:
    num_generated_tokens: int  # after cutting at the first stop token
    nfe: int  # forward evaluations of the batch the request ran in
    refreshes: int  # of which cache refreshes (full-canvas forwards)
    forward_time_s: float  # time inside model forwards of that batch
    wall_time_s: float  # decoding time of that batch
    batch_size: int  # requests decoded together with it (at most)
    affix: AffixRequestStats | None = None  # with SamplingParams.affix_policy


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    stats: RequestStats
