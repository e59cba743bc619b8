"""How one request is decoded. Validated once, at construction."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from acache.policies import (
    ANCHOR_PASSES,
    ANCHOR_QUERIES,
    BICACHE_POLICIES,
    CACHE_POLICIES,
    COMMIT_RULES,
    ONE_PASS_SELECTORS,
    QUERY_SELECTORS,
    SELECTOR_CHOICES,
)

#: the share of a block's masks FOCUS keeps unless ``focus_ratio`` says otherwise
FOCUS_RATIO = 0.25


@dataclass(frozen=True)
class SamplingParams:
    """Diffusion decoding parameters (LLaDA / Fast-dLLM semantics).

    ``gen_length`` masks are appended to the prompt and decoded in blocks of ``block_length``, left to
    right. ``remasking`` picks the commit rule: ``threshold`` (Fast-dLLM parallel decoding, commit
    every masked token whose confidence reaches ``threshold``, at least one a step), ``factor``
    (Fast-dLLM's factor rule) or ``low_confidence`` (LLaDA: ``steps`` split evenly over blocks, a
    fixed quota a step). ``steps`` is read by ``low_confidence`` only: the other rules run a block until it has no
    mask, as Fast-dLLM's do. A shifted model (Dream) under a cache commits a block's first token alone on the
    block's first step, as upstream Fast-dLLM's Dream loop does, so its blocks take at least two forwards even
    where ``steps`` gives them one. ``cache`` is the intra-request KV cache: ``none``, ``prefix`` or ``dual``;
    ``refresh_interval`` refreshes it every that many steps inside a block as well as at block starts (with
    ``none`` every step recomputes everything already, so the same parameters compare the policies).

    ``selector`` turns on cross-request affix reuse for prompts that mark affixes: the anchor
    selector (``attention`` is ACache; ``none`` is direct reuse, ``all`` full recompute; baselines
    ``kv-deviation``, ``query-attention``, ``first-k``, ``random``), recomputing ``anchor_ratio`` of each
    affix's tokens (none of an affix exact where it is placed: a block-causal model's affix at column 0);
    ``anchor_query`` is where ACache's queries come from: ``probe``, ``full`` (a no-cache forward) or
    ``shallow`` (the probe through its first three tenths of the layers only: see
    :func:`acache.affix.context.shallow_layers`).
    ``bicache-matched`` recomputes the deepest ``ceil(anchor_ratio * layers)`` layers instead, and
    ``bicache-profiled`` takes that depth from a profile (``LLM(bicache_profile=...)``).
    ``None`` computes affix tokens like any other prompt tokens. With ``probe_step`` the forward that
    selection runs anyway (the probe: the request's own tokens against the shared affixes' cached K/V,
    as direct reuse computes them) also decodes the first step of the first block, so selection stands in
    for a denoising step instead of adding a forward; the next forward is the first refresh with anchors.
    It trades that one step's accuracy (it sees the affix as direct reuse does) for a forward a request.

    ``stop_token_ids`` end the request besides the model's EOS (and a tokenizer's end-of-turn tokens);
    ``ignore_eos`` (vLLM's field) decodes the whole region through those, as throughput benchmarks need, the
    request's own ``stop_token_ids`` still ending it.

    ``anchor_pass`` is where the anchors are chosen. ``"one"``: inside the request's first refresh forward,
    which runs its first two layers on every column in context, then feeds only the request's own columns and
    the carried candidates, filtering them down to the anchor count layer by layer; every K/V it computes is
    kept, so selection adds no forward (``attention``, ``attention-deviation``, ``cacheblend``,
    ``query-attention``: :mod:`acache.affix.one_pass` says what it computes and where it differs from the
    selection of its own). ``"two"``: a selection of its own before the first refresh (the probe, a full
    forward, CacheBlend's layer-by-layer pass), as the selectors were first defined; a selector that scores from
    the request's layout alone (``first-k``, ``random``, ``none``, ``all``) needs no forward and chooses when the
    request is admitted. ``None`` resolves at
    construction to ``"one"`` where the selector has that form and neither ``probe_step`` nor an
    ``anchor_query`` other than ``probe`` asks for the separate pass, otherwise to ``"two"``. ``anchor_depth``
    d in (0, 1] is how far into the layers the one pass scores: it filters its candidates down to the anchor
    count over the first ``ceil(d * (layers - 1))`` layers after layer 0 and runs the rest with the
    anchors alone; ``None`` resolves to 1.0, every layer (CacheBlend's schedule; docs/accuracy.md measures
    why it stays the default). A depth below 1 needs ``anchor_pass`` ``"one"``.

    Two approximations past the token-count ideal (both off by default): ``far_mask_window`` W leaves the
    mask columns of blocks more than W blocks after the current one out of every forward, fed or
    attended, anchor selection's too (DPad: far masks carry almost nothing); ``focus_layers`` L runs an in-block
    step's first L layers on the whole block, then only the ``focus_ratio`` of its masked tokens that
    attention marks as most likely to be decoded (FOCUS), the block's other tokens attended at the later
    layers through their K/V of the last refresh.
    """

    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None
    remasking: str = "threshold"
    threshold: float = 0.9
    factor: float = 1.0
    temperature: float = 0.0
    cache: str = "dual"
    refresh_interval: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    selector: str | None = None
    anchor_ratio: float = 0.2
    anchor_query: str = "probe"
    probe_step: bool = False
    far_mask_window: int | None = None
    focus_layers: int | None = None
    focus_ratio: float = FOCUS_RATIO
    anchor_pass: str | None = None
    anchor_depth: float | None = None

    def __post_init__(self) -> None:
        for name in ("threshold", "factor", "temperature", "anchor_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # an iterator is read once, here
        for name in ("gen_length", "block_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length ({self.gen_length}) must be a multiple of block_length "
                             f"({self.block_length})")
        blocks = self.num_blocks
        if self.steps is not None:
            if not isinstance(self.steps, int) or isinstance(self.steps, bool):
                raise ValueError(f"steps must be an integer, got {self.steps!r}")
            if self.steps < blocks:
                raise ValueError(f"steps ({self.steps}) must be at least the number of blocks ({blocks} = "
                                 f"gen_length {self.gen_length} / block_length {self.block_length})")
            if self.steps % blocks:
                raise ValueError(f"steps ({self.steps}) must be a multiple of the number of blocks ({blocks}) "
                                 "so that every block gets the same number of steps")
            if self.steps > self.gen_length:
                raise ValueError(f"steps ({self.steps}) cannot exceed gen_length ({self.gen_length})")
        if self.remasking not in COMMIT_RULES:
            raise ValueError(f"remasking must be one of {', '.join(COMMIT_RULES)}, got {self.remasking!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if not self.factor > 0.0:
            raise ValueError(f"factor must be positive, got {self.factor}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.cache not in CACHE_POLICIES:
            raise ValueError(f"cache must be one of {', '.join(CACHE_POLICIES)}, got {self.cache!r}")
        if self.refresh_interval is not None and (
                not isinstance(self.refresh_interval, int) or isinstance(self.refresh_interval, bool)
                or self.refresh_interval <= 0):
            raise ValueError(f"refresh_interval must be a positive integer or None, got {self.refresh_interval!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.selector is not None:
            if self.selector not in SELECTOR_CHOICES:
                raise ValueError(f"selector must be one of {', '.join(SELECTOR_CHOICES)} or None, "
                                 f"got {self.selector!r}")
            if self.cache != "dual":
                raise ValueError(f"affix reuse runs on the dual cache: set cache='dual' (got {self.cache!r})")
        if not 0.0 <= self.anchor_ratio <= 1.0:
            raise ValueError(f"anchor_ratio must be in [0, 1], got {self.anchor_ratio}")
        for name in ("far_mask_window", "focus_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        if self.focus_layers is not None:
            if self.focus_layers == 0:
                raise ValueError("focus_layers must be at least 1: importance is read from the last of them")
            if self.cache != "dual":
                raise ValueError(f"focus_layers focuses the dual cache's in-block steps: set cache='dual' "
                                 f"(got {self.cache!r})")
            if self.remasking == "factor":
                raise ValueError("focus_layers works with remasking 'threshold' or 'low_confidence', not 'factor': "
                                 "its count could reach tokens FOCUS left out")
            if self.refresh_interval == 1:
                raise ValueError("focus_layers focuses the in-block steps, and refresh_interval=1 makes every step "
                                 "a refresh: there would be none to focus")
        if isinstance(self.focus_ratio, bool) or not isinstance(self.focus_ratio, (int, float)) \
                or not 0.0 < self.focus_ratio <= 1.0:
            raise ValueError(f"focus_ratio must be in (0, 1], got {self.focus_ratio!r}")
        if self.focus_layers is None and self.focus_ratio != FOCUS_RATIO:
            raise ValueError(f"focus_ratio ({self.focus_ratio}) applies with focus_layers, which is unset")
        if not isinstance(self.probe_step, bool):
            raise ValueError(f"probe_step must be true or false, got {self.probe_step!r}")
        if self.probe_step and (self.selector is None or self.selector in BICACHE_POLICIES):
            raise ValueError("probe_step decodes the first step from the anchor-selection probe: it needs an "
                             f"anchor selector (not None or BiCache), got {self.selector!r}")
        if self.anchor_query not in ANCHOR_QUERIES:
            raise ValueError(f"anchor_query must be one of {', '.join(ANCHOR_QUERIES)}, got {self.anchor_query!r}")
        # resolved beside the fields, which keep what was asked: replace(params, selector=...) resolves afresh
        object.__setattr__(self, "_anchor_pass", self._resolve_anchor_pass())
        object.__setattr__(self, "_anchor_depth", self._resolve_anchor_depth())

    @property
    def resolved_anchor_pass(self) -> str | None:
        """Where the anchors are chosen: ``one`` (inside the first refresh) or ``two`` (a pass of their own), the
        selector's default where ``anchor_pass`` is None; None without anchor selection (no selector, BiCache)."""
        return self._anchor_pass

    @property
    def resolved_anchor_depth(self) -> float:
        """The share of the layers a one-pass selection scores through: ``anchor_depth``, 1.0 where None."""
        return self._anchor_depth

    def _resolve_anchor_pass(self) -> str | None:
        """``anchor_pass`` checked and resolved: None without anchor selection (no selector, BiCache)."""
        if self.anchor_pass is not None and self.anchor_pass not in ANCHOR_PASSES:
            raise ValueError(f"anchor_pass must be one of {', '.join(ANCHOR_PASSES)} or None, got {self.anchor_pass!r}")
        if self.selector is None or self.selector in BICACHE_POLICIES:
            if self.anchor_pass is not None:
                raise ValueError(f"anchor_pass chooses where anchors are selected: it needs an anchor selector "
                                 f"(not None or BiCache), got {self.selector!r}")
            return None
        query = self.selector in QUERY_SELECTORS and self.anchor_query != "probe"  # the others ignore it
        separate = [why for why, asked in (("probe_step", self.probe_step),
                                           (f"anchor_query={self.anchor_query!r}", query)) if asked]
        if self.anchor_pass == "one":
            if self.selector not in ONE_PASS_SELECTORS:
                raise ValueError(f"anchor selector {self.selector!r} has no one-pass form (it needs a forward the "
                                 f"refresh does not run); one-pass selectors: {', '.join(ONE_PASS_SELECTORS)}")
            if separate:
                raise ValueError(f"anchor_pass='one' chooses anchors inside the refresh, with no probe: "
                                 f"{' and '.join(separate)} need(s) anchor_pass='two'")
            return "one"
        if self.anchor_pass == "two":
            return "two"
        return "one" if self.selector in ONE_PASS_SELECTORS and not separate else "two"

    def _resolve_anchor_depth(self) -> float:
        """``anchor_depth`` checked and resolved: 1.0 where None; below 1 only in one pass."""
        depth = self.anchor_depth
        if depth is None:
            return 1.0
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 < depth <= 1.0:
            raise ValueError(f"anchor_depth must be a number in (0, 1], got {depth!r}")
        if depth < 1.0 and self._anchor_pass is None:
            raise ValueError(f"anchor_depth {depth} is how deep a one-pass selection scores: it needs an anchor "
                             f"selector (not None or BiCache), got {self.selector!r}")
        if depth < 1.0 and self._anchor_pass != "one":
            raise ValueError(f"anchor_depth {depth} scores inside the first refresh: it needs anchor_pass 'one' (the "
                             f"selector {self.selector!r} resolves to {self._anchor_pass!r})")
        return float(depth)

    def affix_reuse(self, has_affixes: bool) -> tuple[bool, bool]:
        """``(reuse, bicache)`` of a request whose prompt has affixes or not: whether it reuses their cached K/V
        (a policy and something to apply it to), and whether by BiCache's layers rather than by anchors. The
        one rule the engine and the reference path both read."""
        reuse = self.selector is not None and has_affixes
        return reuse, reuse and self.selector in BICACHE_POLICIES

    def stop_ids(self, model_stops: Iterable[int]) -> frozenset[int]:
        """The token ids whose finished block ends this request: the model's (its EOS, a tokenizer's end of turn)
        unless ``ignore_eos``, and the request's own ``stop_token_ids`` always. The one rule every decoding path
        reads."""
        return frozenset({*(() if self.ignore_eos else model_stops), *self.stop_token_ids})

    def generator(self, device: object = "cpu", default_seed: int | None = None) -> torch.Generator | None:
        """The request's sampling noise: None at temperature 0; otherwise seeded with ``seed``, else with
        ``default_seed`` (a caller's reproducible stream), else at random. The one place requests are seeded."""
        if self.temperature <= 0:
            return None
        seed = self.seed if self.seed is not None else default_seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        return torch.Generator(device=device).manual_seed(seed)

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        """Steps of the low-confidence schedule in each block (``steps`` defaults to ``gen_length``)."""
        return (self.steps or self.gen_length) // self.num_blocks
