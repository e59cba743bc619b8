"""One request inside the engine: its decoding state, the K/V it holds, and its per-request stats.

Only the scheduler changes a request (admission, anchors, commits, finish); the model runner reads it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from acache.affix.entry import AffixEntry
from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import admission_anchors, make_selector, request_anchor_counts
from acache.decoding.request_state import RequestState
from acache.engine.affix_pages import SharedAffix
from acache.models.config import ModelConfig
from acache.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class RequestMetrics:
    """What the engine records of a request while it runs (vLLM's word); the user gets
    :class:`acache.outputs.RequestStats`, made from it when the request finishes."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    finished: float | None = None
    last_block: float | None = None  # when the request's latest block was completed
    forward_time_s: float = 0.0  # of the batched forwards this request ran in
    max_batch: int = 0  # the most requests it shared a forward with (itself included)
    refresh_times_s: list[float] = field(default_factory=list)  # forwards this request's refreshes ran in
    selection_time_s: float = 0.0
    affix_hits: int = 0
    affix_queries: int = 0
    private_pages: int = 0
    refreshed_tokens: int = 0  # columns its refreshes fed, all together


class Request:
    def __init__(self, request_id: str, prompt: AffixPrompt, params: SamplingParams, config: ModelConfig,
                 shifted: bool, device: torch.device, generator: torch.Generator | None = None,
                 stream: bool = False, stop_token_ids: frozenset[int] | set[int] = frozenset(),
                 state_cache: bool = False) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.generator = generator
        self.stream = stream
        self.state = RequestState(prompt.layout, params, config.mask_token_id, config.pad_token_id, shifted, device,
                                  params.stop_ids(stop_token_ids), config.block_size, state_cache)
        self.reuse, self.bicache = params.affix_reuse(bool(prompt.affixes))
        self.status = Status.WAITING
        self.shared: list[tuple[int, SharedAffix]] = []  # (index in prompt.affixes, shared pool affix)
        self.entries: list[tuple[int, AffixEntry]] = []  # BiCache: (index, dense entry with hidden states)
        self.computed: set[str] = set()  # affixes a try that did not admit it computed (a miss, when admitted)
        self.bicache_depth: int | None = None
        self.num_layers = config.num_layers
        self.private_pages: list[int] = []
        self.private_slots: torch.Tensor | None = None
        self.slot_map: torch.Tensor | None = None  # canvas column -> physical pool slot
        self.stats = RequestMetrics()
        self.error: str | None = None


    @property
    def label(self) -> str:
        """How errors name it: by its id, or "the request" for one only checked (no id yet)."""
        return f"request {self.request_id}" if self.request_id else "the request"

    @property
    def length(self) -> int:
        return self.state.length

    def span_columns(self, index: int) -> tuple[int, int]:
        """Canvas columns ``[c0, c1)`` of the prompt's affix ``index``."""
        span = self.prompt.affixes[index]
        c0 = self.state.canvas.column(0, span.start)
        return c0, c0 + span.length

    @property
    def shared_columns(self) -> torch.Tensor:
        """``[T]``: the columns of the affixes this request shares with others (their K/V in shared pages)."""
        return self.shared_mask([i for i, _ in self.shared])

    def shared_mask(self, indices: list[int]) -> torch.Tensor:
        return self.state.span_mask([self.span_columns(index) for index in indices])

    def private_tokens(self, shared_indices: list[int]) -> int:
        """Slots this request owns when the affixes ``shared_indices`` are shared: its base recompute set
        and the anchors of each shared affix (a BiCache request owns every column)."""
        if self.bicache or not self.reuse:
            return self.length
        base = int(self.state.base_recompute(self.shared_mask(shared_indices)).sum())
        return base + sum(self.anchor_counts(shared_indices))

    @property
    def shared_spans(self) -> list[tuple[int, int]]:
        """Canvas columns ``[c0, c1)`` of each affix shared now, in :attr:`shared`'s order."""
        return [self.span_columns(i) for i, _ in self.shared]

    def anchor_counts(self, shared_indices: list[int] | None = None) -> list[int]:
        """The anchor count of each shared affix (``shared_indices``; default: those shared now), in that order."""
        spans = self.shared_spans if shared_indices is None else [self.span_columns(i) for i in shared_indices]
        return request_anchor_counts(self.state, spans)

    def admission_anchors(self) -> torch.Tensor | None:
        """``[T]``: the anchors this request takes among its shared affixes when it is admitted, or None when a
        forward chooses them (:func:`~acache.affix.selectors.admission_anchors`)."""
        p = self.params
        return admission_anchors(make_selector(p.selector, p.anchor_query), self.state, self.shared_spans,
                                 self.anchor_counts(), self.prompt.token_ids)

    @property
    def cached_tokens(self) -> int:
        """Of :attr:`affix_tokens`, those whose K/V every refresh reads from the shared copy: not the anchors, nor the
        affix columns recomputed beside the request's own (an attention block they share, the column before a
        shifted model's region: ``RequestState.base_recompute``), and none before they are fixed (every column is in
        the recompute set until then). A BiCache request reads its affix tokens' layers below its split from its
        copy, but for those direct reuse recomputes too, and none when it recomputes every layer."""
        if self.bicache:
            if (self.bicache_depth or 0) >= self.num_layers:
                return 0
            return int(self.state.copied_affix_columns([self.span_columns(i) for i, _ in self.entries]).sum())
        return int((self.shared_columns & ~self.state.recompute).sum())

    @property
    def affix_tokens(self) -> int:
        return sum(a.length for _, a in self.shared) + sum(e.length for _, e in self.entries)
