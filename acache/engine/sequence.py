"""One request inside the engine: its canvas, its slot map, and where it is in decoding."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import anchor_count
from acache.decoding.canvas import build_canvas
from acache.decoding.commit import CommitRule, make_commit_rule
from acache.engine.affix_pages import SharedAffix
from acache.models.config import ModelConfig
from acache.sampling_params import SamplingParams


def anchors_per_affix(params: SamplingParams, n: int) -> int:
    """How many of an ``n``-token affix's tokens the request's selector recomputes."""
    if params.affix_policy == "none":
        return 0
    if params.affix_policy == "all":
        return n
    return anchor_count(params.anchor_ratio, n)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class Phase(enum.Enum):
    SELECT = "select"  # anchors still to be chosen
    REFRESH = "refresh"  # the next forward is a block-boundary refresh
    STEP = "step"  # inside a block, feeding only the block


@dataclass
class SequenceStats:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    finished: float | None = None
    nfe: int = 0
    forward_time_s: float = 0.0  # of the batched forwards this request ran in
    max_batch: int = 0  # the most requests it shared a forward with (itself included)
    refresh_times_s: list[float] = field(default_factory=list)  # forwards this request's refreshes ran in
    selection_time_s: float = 0.0
    affix_hits: int = 0
    affix_queries: int = 0
    private_pages: int = 0


class Sequence:
    """A request's canvas (no padding), with per-column roles and physical slots."""

    def __init__(self, request_id: str, prompt: AffixPrompt, params: SamplingParams, config: ModelConfig,
                 device: torch.device, generator: torch.Generator | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.generator = generator
        canvas = build_canvas([prompt.layout], params.gen_length, config.mask_token_id, config.pad_token_id, device)
        self.canvas = canvas
        self.tokens = canvas.tokens[0]
        self.positions = canvas.positions[0]
        self.length = canvas.total
        self.gen_start = canvas.gen_start
        self.mask_token_id = config.mask_token_id
        self.reuse = params.affix_policy is not None and bool(prompt.affixes)
        self.shifted = False
        self.stream = False
        self.status = Status.WAITING
        self.phase = Phase.SELECT
        self.affixes: list[tuple[int, SharedAffix]] = []  # (index in prompt.affixes, shared affix)
        self.anchors = torch.zeros(self.length, dtype=torch.bool, device=device)
        self.recompute = torch.ones(self.length, dtype=torch.bool, device=device)
        self.recompute_count = self.length
        self.slot_map = torch.zeros(self.length, dtype=torch.long, device=device)
        self.private_pages: list[int] = []
        self.private_slots: torch.Tensor | None = None
        self.block = 0
        self.step = 0
        self.masked: torch.Tensor | None = None
        self.rule: CommitRule = make_commit_rule(params)
        self.stats = SequenceStats()
        self.output: list[int] | None = None

    # -- sizes ------------------------------------------------------------------------------------
    def private_tokens(self, shareable: list[int]) -> int:
        """Tokens whose K/V this request owns when the affixes of lengths ``shareable`` are shared:
        everything else plus ``ceil(ratio * n)`` anchors of each shared affix (one more for a shifted
        model, whose column before the generation region must be fresh)."""
        if not self.reuse:
            return self.length
        anchors = sum(anchors_per_affix(self.params, n) for n in shareable)
        return self.length - sum(shareable) + anchors + (1 if self.shifted else 0)

    def set_anchors(self, anchors: torch.Tensor) -> None:
        """Fixes which columns every refresh recomputes and maps each column to its physical slot:
        recomputed columns to this request's private slots, the other affix columns to shared ones."""
        shared = torch.zeros(self.length, dtype=torch.bool, device=self.tokens.device)
        shared_slot = torch.zeros(self.length, dtype=torch.long, device=self.tokens.device)
        for index, affix in self.affixes:
            c0 = self.canvas.column(0, self.prompt.affixes[index].start)
            shared[c0:c0 + affix.length] = True
            shared_slot[c0:c0 + affix.length] = affix.slots
        self.anchors = anchors & shared
        recompute = ~shared | self.anchors
        if self.shifted and self.gen_start > 0:
            recompute[self.gen_start - 1] = True  # the state that predicts the region's first token
        count = int(recompute.sum())
        if count > self.private_slots.numel():
            raise RuntimeError(f"request {self.request_id} recomputes {count} tokens but holds "
                               f"{self.private_slots.numel()} private slots")
        slot_map = shared_slot.clone()
        slot_map[recompute] = self.private_slots[:count]
        self.recompute = recompute
        self.recompute_count = count
        self.slot_map = slot_map
        self.begin_block()
        self.phase = Phase.REFRESH

    @property
    def affix_tokens(self) -> int:
        return sum(a.length for _, a in self.affixes)

    # -- decoding state ---------------------------------------------------------------------------
    @property
    def block_cols(self) -> tuple[int, int]:
        start = self.gen_start + self.block * self.params.block_length
        return start, start + self.params.block_length

    def begin_block(self) -> None:
        start, end = self.block_cols
        self.masked = self.tokens[start:end] == self.mask_token_id
        self.rule.begin_block(self.masked.sum()[None])
        self.step = 0

    def is_refresh_step(self) -> bool:
        interval = self.params.refresh_interval
        return self.step == 0 or (interval is not None and self.step % interval == 0)

    def advance(self) -> bool:
        """After a commit: moves to the next step or block; True when the request is done."""
        self.step += 1
        if bool(self.masked.any()):
            self.phase = Phase.REFRESH if self.is_refresh_step() else Phase.STEP
            return False
        self.block += 1
        if self.block >= self.params.num_blocks:
            return True
        self.begin_block()
        self.phase = Phase.REFRESH
        return False
