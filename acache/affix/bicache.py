"""BiCache baselines on the same dual-cache decoding: reuse whole shallow layers instead of tokens.

*Matched layers*: the deep ``D = ceil(ratio * L)`` layers are recomputed for every token. At each
refresh the request's own tokens run the shallow ``L - D`` layers alone against the cached affix K/V;
then the affix's hidden state captured at layer ``L - D`` of its affix-only pass is spliced in and the
deep layers run on the whole sequence. The affix columns direct reuse recomputes too (a shifted model's column
before the generation region, an attention block shared with the request's own columns) run with the request's
own. ``D = L`` is full recomputation, ``D = 0`` direct reuse.

*Profiled*: ``D`` comes from a table built on a calibration set (``acache bicache-profile``, in the lab): for each
share of affix tokens in the request, the leading layers whose affix K/V stay above ``tau`` cosine
similarity (alone vs in context) are safe to reuse; the rest are recomputed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from acache.affix.persistence import model_fingerprint
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


@torch.inference_mode()
def bicache_forward(model: DiffusionLM, split: int, own_ids: torch.Tensor, own_pos: torch.Tensor,
                    own_valid: torch.Tensor, affix_past: KVCache, fed_hidden: torch.Tensor, own_index: torch.Tensor,
                    fed_pos: torch.Tensor, fed_valid: torch.Tensor) -> tuple[ForwardOutput, KVCache, KVCache]:
    """BiCache's refresh of a batch that shares one split layer.

    The request's own tokens ``own_ids [B, O]`` run layers ``0..split-1`` against the cached affix K/V
    ``affix_past``; their states are spliced into ``fed_hidden [B, F, hidden]`` (the affix-alone states at
    layer ``split`` at every fed affix column) at ``own_index [B, O]`` (index ``F`` for padding); the deep
    layers then run on all ``F`` fed columns. Returns the normed final states, the own tokens' shallow
    K/V and every fed column's deep K/V.
    """
    layers = len(model.layers)
    if not 0 <= split <= layers:
        raise ValueError(f"BiCache split layer {split} is outside 0..{layers}")
    b, f = fed_pos.shape
    shallow = model.run_layers(model.embed(own_ids), own_pos, own_valid, affix_past, range(0, split), return_kv=True)
    h = torch.cat((fed_hidden, fed_hidden[:, :1]), dim=1).to(model.dtype)
    h.scatter_(1, own_index[..., None].expand(-1, -1, h.shape[-1]), shallow.hidden.to(h.dtype))
    deep = model.run_layers(h[:, :f], fed_pos, fed_valid, None, range(split, layers), return_kv=True)
    return ForwardOutput(model.norm(deep.hidden)), shallow.kv, deep.kv


def bicache_depth(policy: str, ratio: float, num_layers: int, affix_share: float,
                  profile: BiCacheProfile | None) -> int:
    """Deep layers one request recomputes: matched to its anchor ratio, or read from the profile by the
    share of its tokens that are affix tokens."""
    if policy == "bicache-matched":
        return matched_depth(ratio, num_layers)
    if profile is None:
        raise ValueError("selector 'bicache-profiled' needs a BiCache profile: build one with "
                         "`acache bicache-profile` and pass it to LLM(bicache_profile=...)")
    return profile.depth(affix_share)


def matched_depth(ratio: float, num_layers: int) -> int:
    """BiCache matched to an anchor ratio: ``ceil(ratio * L)`` deep layers."""
    return min(num_layers, math.ceil(ratio * num_layers * (1 - 1e-12)))
