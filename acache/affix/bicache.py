"""BiCache baselines on the same dual-cache generation: reuse whole shallow layers instead of tokens.

*Matched layers*: the deep ``D = ceil(ratio * L)`` layers are recomputed for every token. At each
refresh the request's own tokens run the shallow ``L - D`` layers alone against the cached affix K/V;
then the affix's hidden state captured at layer ``L - D`` of its affix-only pass is spliced in and the
deep layers run on the whole sequence. ``D = L`` is full recomputation, ``D = 0`` direct reuse.

*Profiled*: ``D`` comes from a table built by :func:`profile_bicache` on a calibration set: for each
share of affix tokens in the request, the leading layers whose affix K/V stay above ``tau`` cosine
similarity (alone vs in context) are safe to reuse; the rest are recomputed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from acache.affix.context import compact_index
from acache.affix.policy import Placements, place_affixes
from acache.affix.prompt import AffixPrompt
from acache.affix.staleness import measure_staleness
from acache.affix.store import AffixStore, model_fingerprint
from acache.decoding.cache_policy import CachePolicy, StepPlan
from acache.decoding.canvas import Canvas
from acache.models.base import DiffusionLM, ForwardOutput
from acache.models.kv import KVCache

DEFAULT_TAU = 0.97


@dataclass
class BiCacheProfile:
    """Safe shallow depth by affix share: bin ``i`` covers shares up to ``max_share[i]``."""

    num_layers: int
    tau: float
    max_share: list[float]
    safe_layers: list[int]
    samples: list[int]
    model_fingerprint: str = ""

    def depth(self, share: float) -> int:
        """Deep layers to recompute for a request whose affixes are ``share`` of its tokens."""
        for edge, safe in zip(self.max_share, self.safe_layers, strict=True):
            if share <= edge + 1e-12:
                return self.num_layers - safe
        return self.num_layers - self.safe_layers[-1]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path, model: DiffusionLM | None = None) -> BiCacheProfile:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no BiCache profile at {path}: run `acache bicache-profile` first")
        profile = cls(**json.loads(path.read_text()))
        if model is not None and profile.num_layers != len(model.layers):
            raise ValueError(f"BiCache profile {path} was made for {profile.num_layers} layers, the model has "
                             f"{len(model.layers)}")
        if model is not None and profile.model_fingerprint and profile.model_fingerprint != model_fingerprint(model):
            raise ValueError(f"BiCache profile {path} was made with another model; profile this one with "
                             "`acache bicache-profile`")
        return profile


def profile_bicache(store: AffixStore, prompts: Sequence[AffixPrompt], gen_length: int, tau: float = DEFAULT_TAU,
                    bins: int = 10) -> BiCacheProfile:
    """Builds the depth table from calibration prompts. Each share bin keeps its most cautious (smallest)
    safe depth; a bin without samples borrows from the nearest bin that has some."""
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    layers = len(store.model.layers)
    found: list[list[int]] = [[] for _ in range(bins)]
    for prompt in prompts:
        s = measure_staleness(store, prompt, gen_length)
        # bin k holds shares in (k/bins, (k+1)/bins], as depth() reads them
        found[min(bins - 1, max(0, math.ceil(s.affix_share * bins - 1e-12) - 1))].append(s.safe_layers(tau))
    if not any(found):
        raise ValueError("BiCache profiling needs at least one calibration prompt with an affix")
    safe = [min(v) if v else None for v in found]
    filled = []
    for i in range(bins):
        if safe[i] is not None:
            filled.append(safe[i])
            continue
        near = min((j for j in range(bins) if safe[j] is not None), key=lambda j: (abs(j - i), j))
        filled.append(safe[near])

    return BiCacheProfile(layers, tau, [(i + 1) / bins for i in range(bins)], filled, [len(v) for v in found],
                          model_fingerprint(store.model))


class BiCacheDualCache(CachePolicy):
    """BiCache's refresh on the dual cache; ``depth`` deep layers are recomputed for every token
    (a batch uses the deepest depth any of its rows asks for)."""

    name = "bicache"

    def __init__(self, placements: Placements, depths: Sequence[int], refresh_interval: int | None = None) -> None:
        super().__init__(refresh_interval)
        self.placements = placements
        self.depths = list(depths)

    def begin(self, model: DiffusionLM, canvas: Canvas) -> None:
        self.kv = None
        self.model = model
        t = self.total = canvas.total
        layers = len(model.layers)
        self.depth = max(self.depths) if self.depths else layers
        if not 0 <= self.depth <= layers:
            raise ValueError(f"BiCache depth {self.depth} is outside 0..{layers}")
        self.split = layers - self.depth
        self.buf, slot = place_affixes(model, canvas, self.placements)
        affix = slot >= 0
        self.fed, self.fed_valid = compact_index(canvas.valid, fill=t)
        self.affix_cols, self.affix_valid = compact_index(affix, fill=t)
        fed_cols = self.fed.clamp_max(t - 1)
        fed_is_affix = affix.gather(1, fed_cols) & self.fed_valid
        f = self.fed.shape[1]
        self.own, self.own_valid = compact_index(self.fed_valid & ~fed_is_affix, fill=f)  # within the fed list
        # affix hidden states at the split layer, laid out over the fed list
        hidden = torch.zeros(canvas.tokens.shape[0], f, model.config.hidden_size, dtype=model.dtype,
                             device=model.device)
        for row, items in enumerate(self.placements):
            for index, entry in items:
                c0 = canvas.column(row, index)
                where = (self.fed[row] >= c0) & (self.fed[row] < c0 + entry.length) & self.fed_valid[row]
                hidden[row, where] = entry.hidden[self.split].to(model.dtype)
        self.affix_hidden = hidden
        self.fed_position = canvas.valid.long().cumsum(-1) - 1
        self.anchors = torch.zeros_like(affix)
        self.recompute = canvas.valid & ~affix if self.depth == 0 else canvas.valid.clone()
        self.affix_slot = slot

    def plan(self, step: int, start: int, end: int, total: int) -> StepPlan:
        if self.is_refresh(step):
            return StepPlan(self.fed.clamp_max(self.total - 1), None, True, self.fed_position[:, start:end],
                            self.fed_valid, forward=self._refresh)
        return StepPlan(slice(start, end), self.kv, False, slice(0, end - start))

    def _refresh(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> ForwardOutput:
        model, split, layers = self.model, self.split, len(self.model.layers)
        b, f = ids.shape
        own = self.own.clamp_max(f - 1)
        own_valid = self.own_valid & valid.gather(1, own)
        past = self.buf.gather(self.affix_cols, self.affix_valid)
        shallow = model.run_layers(model.embed(ids.gather(1, own)), pos.gather(1, own), own_valid, past,
                                   range(0, split), return_kv=True)
        h = torch.cat((self.affix_hidden, self.affix_hidden[:, :1]), dim=1).clone()
        h.scatter_(1, self.own[..., None].expand(-1, -1, h.shape[-1]), shallow.hidden.to(h.dtype))
        deep = model.run_layers(h[:, :f], pos, valid, None, range(split, layers), return_kv=True)
        keys, values = [], []
        fed = self.fed.clamp_max(self.total - 1)
        for layer in range(split):  # affix entries keep their cached K/V; own tokens take the fresh ones
            k = torch.cat((self.buf.keys[layer].gather(1, fed[..., None, None].expand(
                -1, -1, *self.buf.keys[layer].shape[2:])), self.buf.keys[layer][:, :1]), dim=1)
            v = torch.cat((self.buf.values[layer].gather(1, fed[..., None, None].expand(
                -1, -1, *self.buf.values[layer].shape[2:])), self.buf.values[layer][:, :1]), dim=1)
            idx = self.own[..., None, None].expand_as(shallow.kv.keys[layer])
            k.scatter_(1, idx, shallow.kv.keys[layer])
            v.scatter_(1, idx, shallow.kv.values[layer])
            keys.append(k[:, :f])
            values.append(v[:, :f])
        keys += deep.kv.keys
        values += deep.kv.values
        return ForwardOutput(model.norm(deep.hidden), KVCache(keys, values, pos, valid))

    def store(self, kv: KVCache, plan: StepPlan, start: int, end: int) -> None:
        self.buf.scatter(self.fed, kv)
        self.kv = self.buf.outside(start, end)


def matched_depth(ratio: float, num_layers: int) -> int:
    """BiCache matched to an anchor ratio: ``ceil(ratio * L)`` deep layers."""
    return min(num_layers, math.ceil(ratio * num_layers - 1e-9))
