"""The one per-request decoding state machine, driven alike by the engine and by the reference path.

A request's canvas is its prompt with ``gen_length`` masks at its generation region (no padding). The
state says, before every forward, which canvas columns to feed and which to read from the request's
K/V cache (:meth:`RequestState.plan`), and takes the proposals of the current block back
(:meth:`RequestState.commit`). Every decoding rule lives here once:

* the refresh test: a block's first step, and every ``refresh_interval`` steps inside it;
* what a step feeds under each cache policy (``none``: everything; ``prefix``: the block and after it;
  ``dual``: the block alone) and, on a refresh, the columns to recompute (all of them, or with shared
  affixes the non-affix columns plus the anchors);
* the shifted-head rule of Dream-style models: the column before the generation region is always
  recomputed, and a block's first token is committed alone on its first step when later steps cannot
  see the column before the block;
* the end: after the last block, or after the first finished block that holds a stop token (the output
  is cut at the first stop token, so decoding the blocks after it would be wasted).
* block-causal models (``attention_block``): a step feeds the whole attention blocks its block touches
  (and, for a shifted model, the column before it) against the K/V of the attention blocks before them,
  which are final, so every cache is exact; shared affix columns in an attention block that also holds
  other columns are recomputed at every refresh (their K/V depend on those columns), and an affix at column 0
  is exact where it is placed (:meth:`RequestState.exact_affixes`: it takes no anchors).
* models whose cache is their own object (``state_cache``: the state-space variant, R2LM): every step of a
  cached policy feeds the blocks the current block touches against a cache of every column before them, which
  the executor advances over the newly finished columns on the block's first step (the refresh); the cache
  is exact, so ``refresh_interval`` has nothing to refresh.

The executor (the paged engine, or the dense reference loop) runs the forward and applies the K/V writes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from acache.decoding.canvas import Layout, build_canvas
from acache.decoding.commit import commit_step, make_commit_rule
from acache.sampling_params import SamplingParams


class Phase(enum.Enum):
    SELECT = "select"  # the shared affixes are placed and the anchors still to be chosen
    REFRESH = "refresh"  # the next forward recomputes the cache
    STEP = "step"  # the next forward feeds part of the canvas against the cache
    DONE = "done"


@dataclass(frozen=True)
class StepPlan:
    """What the next forward of one request feeds: canvas columns ``fed`` (ascending) against the cached
    K/V of columns ``past``; ``block`` locates the current block's columns among the fed ones. With
    ``write`` the fed columns' fresh K/V replace the cached ones. With ``select`` (a request's first refresh under
    ``anchor_pass="one"``) the fed columns are every near column: the forward chooses the anchors and keeps
    the K/V of its own columns and of them alone."""

    fed: torch.Tensor  # [F]
    past: torch.Tensor  # [P]
    block: torch.Tensor  # [L], indices into fed
    refresh: bool
    write: bool
    select: bool = False


def truncate_at_stop(ids: list[int], stop_token_ids: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in stop_token_ids:
            return ids[:i]
    return ids


class RequestState:
    """Where one request is in decoding: its canvas, block, step, masks and the columns it recomputes."""

    def __init__(self, layout: Layout, params: SamplingParams, mask_token_id: int, pad_token_id: int,
                 shifted: bool, device: torch.device, stop_token_ids: frozenset[int] | set[int] = frozenset(),
                 attention_block: int | None = None, state_cache: bool = False) -> None:
        if state_cache and attention_block is None:
            raise ValueError("a state-cache model is block-causal: give its attention_block")
        canvas = build_canvas([layout], params.gen_length, mask_token_id, pad_token_id, device)
        self.canvas = canvas
        self.params = params
        self.tokens = canvas.tokens[0]
        self.positions = canvas.positions[0]
        self.length = canvas.total
        self.gen_start = canvas.gen_start
        self.mask_token_id = mask_token_id
        self.shifted = shifted
        self.stop_token_ids = frozenset(stop_token_ids)
        self.attention_block = attention_block  # the model's block-causal block length (None: bidirectional)
        self.state_cache = state_cache
        self.phase = Phase.SELECT
        self.block = 0
        self.step = 0
        self.masked: torch.Tensor | None = None
        self.rule = make_commit_rule(params)
        self.anchors = torch.zeros(self.length, dtype=torch.bool, device=device)
        self.recompute = torch.ones(self.length, dtype=torch.bool, device=device)
        self.selecting = False  # the first refresh still has to choose the anchors (anchor_pass="one")
        self._shared = torch.zeros(self.length, dtype=torch.bool, device=device)
        self.nfe = 0
        self.refreshes = 0
        self._cols = torch.arange(self.length, device=device)
        self._plans: dict[Phase, StepPlan] = {}
        self._plans_block = -1

    # -- the columns a refresh recomputes ---------------------------------------------------------
    def span_mask(self, spans: Sequence[tuple[int, int]], device: torch.device | None = None) -> torch.Tensor:
        """``[T]``: the columns ``[c0, c1)`` of ``spans``, on ``device`` (default: the request's; the host's to
        read without waiting for a device)."""
        mask = torch.zeros(self.length, dtype=torch.bool, device=device or self.tokens.device)
        for c0, c1 in spans:
            mask[c0:c1] = True
        return mask

    def base_recompute(self, shared: torch.Tensor) -> torch.Tensor:
        """Columns recomputed at every refresh before any anchor: all but the ``shared`` affix columns,
        and, for a shifted model, the column before the generation region (its state predicts the
        region's first token, so it must be fresh)."""
        recompute = ~shared
        if self.shifted and self.gen_start > 0:
            recompute = recompute.clone()
            recompute[self.gen_start - 1] = True
        if self.attention_block is not None:  # an attention block mixing shared and own columns: all fresh
            size = self.attention_block
            blocks = -(-self.length // size)
            own = F.pad(~shared, (0, blocks * size - self.length)).view(blocks, size).any(-1)
            recompute = recompute | own.repeat_interleave(size)[:self.length]
        return recompute

    def copied_affix_columns(self, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``[T]``: the columns of the affixes at ``spans`` whose K/V come from their copy, all but those
        :meth:`base_recompute` recomputes anyway (BiCache's shallow layers read these; ``cached_tokens`` counts
        them)."""
        affix = self.span_mask(spans)
        return affix & ~self.base_recompute(affix)

    def exact_affixes(self, spans: list[tuple[int, int]]) -> list[bool]:
        """For each shared affix at canvas columns ``[c0, c1)``: whether the K/V it was cached with (computed
        alone, at positions ``0..n-1``) are exactly the K/V this request's forwards would compute for the columns
        they do not recompute anyway. Only on a block-causal model, for an affix at column 0 whose attention blocks
        hold nothing but it, or whose last, partial block is recomputed (it holds the request's own columns): each
        of its other columns then sees only earlier columns of the same affix, at the same positions. Anchors
        there would recompute what the cache already holds."""
        if self.attention_block is None or self.state_cache:
            return [False] * len(spans)
        # on the host, read with no wait for the device; a last, partial block that holds own columns is recomputed
        recomputed = self.base_recompute(self.span_mask(spans, torch.device("cpu")))
        return [c0 == 0 and c1 > 0 and (c1 % self.attention_block == 0 or bool(recomputed[c1 - 1]))
                for c0, c1 in spans]

    def admit(self, shared: torch.Tensor | None = None, anchors: torch.Tensor | None = None,
              select: bool = False) -> None:
        """Fixes, once before the first block, the columns every refresh recomputes; the one way a request
        leaves :attr:`Phase.SELECT`. Without ``shared`` every column is the request's own (no affix reused,
        BiCache, a state-cache family). With ``shared`` (``[T]``, the reused affix columns): the base set plus
        the ``anchors`` among them, or with ``select`` the anchors chosen inside the first refresh
        (``anchor_pass="one"``), whose plan then feeds every near column, affixes included
        (:attr:`StepPlan.select`), and :meth:`fix_anchors` takes them back before that forward is committed."""
        if self.phase is not Phase.SELECT:
            raise RuntimeError("a request's recompute set is fixed once, before its first block")
        if shared is None:
            if anchors is not None or select:
                raise ValueError("anchors need the shared columns they are chosen from")
            shared = torch.zeros(self.length, dtype=torch.bool, device=self.tokens.device)
            anchors = shared
        elif select == (anchors is not None):
            raise ValueError("the anchors are either given or chosen inside the first refresh (select=True)")
        self._shared = shared
        self.selecting = select
        # while the first refresh selects, it feeds every shared column too and no anchor is fixed yet
        chosen = torch.zeros_like(shared) if select else anchors & shared
        self._fix(self.base_recompute(shared) | (shared if select else chosen), chosen)
        self._begin_block()

    def fix_anchors(self, anchors: torch.Tensor) -> None:
        """The anchors the first refresh chose inside its forward (``anchor_pass="one"``): from here on every
        refresh recomputes the base set and them."""
        if not self.selecting:
            raise RuntimeError("this request's anchors were fixed before its first refresh")
        self.selecting = False
        chosen = anchors & self._shared
        self._fix(self.base_recompute(self._shared) | chosen, chosen)
        self._plans, self._plans_block = {}, -1

    def _fix(self, recompute: torch.Tensor, anchors: torch.Tensor) -> None:
        self.anchors = anchors
        self.recompute = recompute
        # fixed from here on: every refresh feeds these columns against the rest
        self._refresh_fed, self._refresh_past = self._cols[self.recompute], self._cols[~self.recompute]

    @property
    def recompute_count(self) -> int:
        return int(self.recompute.sum())

    @property
    def refresh_fed_count(self) -> int:
        """The columns a refresh of the current block feeds: the recompute set's, but for the far masks a
        ``far_mask_window`` leaves out; a state-cache family's, the step span."""
        if self.state_cache:
            first, last = self.step_span()
            return last - first
        return int((self.recompute & ~self.far_columns()).sum())

    # -- the step rules ---------------------------------------------------------------------------
    @property
    def block_cols(self) -> tuple[int, int]:
        start = self.gen_start + self.block * self.params.block_length
        return start, start + self.params.block_length

    @property
    def force_head(self) -> bool:
        """A shifted model commits a block's first token alone on its first step when later steps feed
        the block without the column before it: every cache but ``none``, unless every step refreshes or
        the model is block-causal (its steps feed that column)."""
        return (self.shifted and self.params.cache != "none" and self.params.refresh_interval != 1
                and self.attention_block is None)

    def is_refresh_step(self) -> bool:
        if self.params.cache == "none":
            return False
        if self.state_cache:
            return self.step == 0
        interval = self.params.refresh_interval
        return self.step == 0 or (interval is not None and self.step % interval == 0)

    def plan(self) -> StepPlan:
        """What the next forward feeds; the same for every step of a phase within a block, so it is built
        once a block and phase, not at every step."""
        if self.phase not in (Phase.REFRESH, Phase.STEP):
            raise RuntimeError(f"request in phase {self.phase.value} has no forward to plan")
        if self._plans_block != self.block:
            self._plans, self._plans_block = {}, self.block
        if self.phase not in self._plans:
            self._plans[self.phase] = self._make_plan()
        return self._plans[self.phase]

    def far_columns(self) -> torch.Tensor:
        """``[T]``: the generation columns of blocks more than ``far_mask_window`` blocks after the current
        one (all False without a window). They are still masks; a block's first step, a refresh, feeds
        the ones its window has reached."""
        far = torch.zeros(self.length, dtype=torch.bool, device=self._cols.device)
        window = self.params.far_mask_window
        if window is not None:
            edge = self.block_cols[1] + window * self.params.block_length
            far[edge:self.gen_start + self.params.gen_length] = True
        return far

    def _make_plan(self) -> StepPlan:
        start, end = self.block_cols
        cols = self._cols
        near = ~self.far_columns()
        if self.params.cache == "none":
            fed = cols[near]
            return StepPlan(fed, cols[:0], torch.searchsorted(fed, cols[start:end]), refresh=False, write=False)
        if self.state_cache:
            first, last = self.step_span()
            refresh = self.phase is Phase.REFRESH
            return StepPlan(cols[first:last], cols[:first], cols[start - first:end - first], refresh, refresh)
        if self.phase is Phase.REFRESH:
            fed = self._refresh_fed[near[self._refresh_fed]]
            past = self._refresh_past[near[self._refresh_past]]
            return StepPlan(fed, past, torch.searchsorted(fed, cols[start:end]), True, True, self.selecting)
        if self.attention_block is not None:
            first, last = self.step_span()
            block = cols[start - first:end - first]
            fed = cols[first:][near[first:]] if self.params.cache == "prefix" else cols[first:last]
            return StepPlan(fed, cols[:first], block, refresh=False, write=False)
        block = cols[:end - start]
        if self.params.cache == "prefix":
            return StepPlan(cols[start:][near[start:]], cols[:start], block, refresh=False, write=False)
        past = torch.cat((cols[:start], cols[end:][near[end:]]))
        return StepPlan(cols[start:end], past, block, refresh=False, write=False)

    def step_span(self) -> tuple[int, int]:
        """Block-causal models: the columns ``[first, last)`` an in-block step feeds, the attention blocks the
        current block touches (with the column before it for a shifted model). The columns before ``first``
        are final and later ones unseen, so their cached K/V are exact."""
        size, (start, end) = self.attention_block, self.block_cols
        head = start - 1 if self.shifted and start > 0 else start
        return head // size * size, min(-(-end // size) * size, self.length)

    def commit(self, x0: torch.Tensor, conf: torch.Tensor, probe: bool = False) -> bool:
        """Takes the block's proposals ``x0``/``conf`` ``[L]`` of the forward just planned; True when done.

        ``probe`` marks the proposals of the anchor-selection probe (``probe_step``), which decodes the
        first step of the first block: it wrote no K/V, so the block's next forward is a refresh whatever
        the interval."""
        if probe and (self.phase is not Phase.REFRESH or self.block or self.step):
            raise RuntimeError("the selection probe decodes only the first step of the first block")
        refresh = self.phase is Phase.REFRESH and not probe
        self.nfe += 1
        self.refreshes += int(refresh)
        start, end = self.block_cols
        tokens, masked = commit_step(self.rule, self.tokens[None, start:end], x0[None], conf[None],
                                     self.masked[None], self.step, self.force_head)
        self.tokens[start:end], self.masked = tokens[0], masked[0]
        self.step += 1
        if bool(self.masked.any()):
            self.phase = Phase.REFRESH if probe or self.is_refresh_step() else Phase.STEP
            return False
        self.block += 1
        # a finished block holding a stop token ends the request: the output is cut there whatever follows
        stopped = not self.stop_token_ids.isdisjoint(self.tokens[start:end].tolist())
        if stopped or self.block >= self.params.num_blocks:
            self.phase = Phase.DONE
            return True
        self._begin_block()
        return False

    def _begin_block(self) -> None:
        start, end = self.block_cols
        self.masked = self.tokens[start:end] == self.mask_token_id
        self.rule.begin_block(self.masked.sum()[None], self.force_head)
        self.step = 0
        self.phase = Phase.REFRESH if self.is_refresh_step() else Phase.STEP

    # -- output -----------------------------------------------------------------------------------
    def generated(self, finished_blocks_only: bool = False) -> list[int]:
        n = self.block * self.params.block_length if finished_blocks_only or self.phase is Phase.DONE \
            else self.params.gen_length
        return self.tokens[self.gen_start:self.gen_start + n].tolist()

    def output(self, finished_blocks_only: bool = False) -> tuple[list[int], int | None]:
        """The generated ids cut at the first stop token, and that stop token (None if none cut them)."""
        ids = self.generated(finished_blocks_only)
        cut = truncate_at_stop(ids, self.stop_token_ids)
        return cut, ids[len(cut)] if len(cut) < len(ids) else None
