"""What a request returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AffixRequestStats:
    selector: str
    anchor_ratio: float
    affix_tokens: int  # shared affix tokens of the request
    anchors: list[int]  # absolute positions of the recomputed affix tokens
    recomputed_per_refresh: int  # tokens this request fed a refresh, on average (a far-mask window feeds fewer early)
    refresh_times_s: list[float] = field(default_factory=list)  # of the batched forwards its refreshes ran in
    selection_time_s: float = 0.0  # of the batched anchor selection it ran in
    affix_hits: int = 0
    affix_misses: int = 0
    bicache_depth: int | None = None  # deep layers recomputed, for the BiCache policies
    #: of ``affix_tokens``, those read from the shared copy at every refresh: not the anchors, nor the affix columns
    #: recomputed beside the request's own (an attention block they share, the column before a shifted model's region)
    cached_tokens: int = 0


@dataclass
class RequestStats:
    num_generated_tokens: int  # after cutting at the first stop token
    nfe: int  # forward evaluations of this request
    refreshes: int  # of which cache refreshes
    forward_time_s: float  # time inside the batched forwards it ran in
    wall_time_s: float  # from arrival to finish
    batch_size: int  # the most requests it shared a forward with (itself included)
    affix: AffixRequestStats | None = None  # with SamplingParams.selector


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    stats: RequestStats
    error: str | None = None  # why the request failed; its tokens are then empty
    stop_token_id: int | None = None  # the stop token (EOS) that ended the text before gen_length, if one did

    @property
    def finish_reason(self) -> str:
        """``stop`` when a stop token ended the text, ``length`` when the generation region did (vLLM's words),
        ``error`` when the request failed."""
        if self.error is not None:
            return "error"
        return "stop" if self.stop_token_id is not None else "length"
