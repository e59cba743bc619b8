"""Neighbour prediction inside an isolated affix: a training-only term that rewards an affix token's states for
naming the tokens around it.

Under direct reuse the question can only read what the affix computed alone, so the binding it asks about
("apple went to mary": which holder follows the object) must sit in the affix tokens' own states. Trained on the
answer alone, neither half of that route pays before the other exists: an object's state gains nothing from
holding its holder while no question looks it up, and a question gains nothing from looking up objects whose
states hold nothing. From scratch such a model stays at chance on ``grab`` for 30,000 steps (docs/accuracy.md,
"Neighbours named inside the affix"). This term pays for the first half on its own: at one layer's output, each
isolated affix token predicts, through one linear map per offset and the model's own final norm and output
embedding, the tokens at offsets ``-span..-1`` and ``1..span`` inside its affix. The maps are discarded after
training, so the model keeps its shape; the norm and the embedding it shares are trained by the term too.

On a released checkpoint (LoRA, :mod:`acache_lab.train.lora`) a full map per offset would be eight 4096 x 4096
matrices and every affix pair a row of a 126k-token output embedding, so there the maps are low-rank and each
offset's pairs are sampled.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from acache.models.base import DiffusionLM


class NeighbourHeads(nn.Module):
    """One ``hidden x hidden`` map per offset in ``-span..-1, 1..span``: what a token's state says of its
    neighbour there, before the model's output embedding. With ``rank`` each map is the product of a
    ``hidden x rank`` and a ``rank x hidden`` factor."""

    def __init__(self, hidden_size: int, span: int, rank: int | None = None) -> None:
        super().__init__()
        if not is_whole(span, 1):
            raise ValueError(f"span is a positive number of tokens, not {span!r}")
        if rank is not None and not is_whole(rank, 1):
            raise ValueError(f"rank is a positive number of dimensions or None (full maps), not {rank!r}")
        self.offsets = tuple(o for o in range(-span, span + 1) if o)
        self.maps = nn.ModuleList(_map(hidden_size, rank) for _ in self.offsets)


def _map(hidden_size: int, rank: int | None) -> nn.Module:
    if rank is None:
        return nn.Linear(hidden_size, hidden_size, bias=False)
    return nn.Sequential(nn.Linear(hidden_size, rank, bias=False), nn.Linear(rank, hidden_size, bias=False))


def neighbour_loss(model: DiffusionLM, heads: NeighbourHeads, states: torch.Tensor, ids: torch.Tensor,
                   owner: torch.Tensor, pairs: int | None = None, gen: torch.Generator | None = None) -> torch.Tensor:
    """Cross-entropy of each affix column's neighbours, predicted from ``states [B, T, hidden]``: for every offset
    ``o`` of ``heads``, the columns ``c`` with ``owner[b, c] > 0`` and ``owner[b, c + o] == owner[b, c]`` (the same
    span of ``owner [B, T]``, :func:`~acache_lab.train.isolation.span_owners`) predict ``ids[b, c + o]``. The mean over
    such pairs of each offset, averaged over the offsets that have any; zero when none has. With ``pairs`` an offset
    with more pairs than that predicts a uniform draw of ``pairs`` of them (from the CPU generator ``gen``), an
    unbiased estimate of its mean at a bounded cost; without, nothing is drawn from ``gen``."""
    if pairs is not None and (not is_whole(pairs, 1) or gen is None):
        raise ValueError(f"pairs is a positive number of pairs an offset, drawn with a generator; got {pairs!r}")
    t = ids.shape[1]
    terms = []
    for offset, lin in zip(heads.offsets, heads.maps, strict=True):
        src = torch.arange(max(0, -offset), min(t, t - offset), device=ids.device)
        rows, at = ((owner[:, src] > 0) & (owner[:, src] == owner[:, src + offset])).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        if pairs is not None and rows.numel() > pairs:
            keep = torch.randperm(rows.numel(), generator=gen)[:pairs].to(rows.device)
            rows, at = rows[keep], at[keep]
        cols = src[at]
        predicted = model.unembed(model.norm(apply_map(lin, states[rows, cols])))
        terms.append(F.cross_entropy(predicted, ids[rows, cols + offset]))
    if not terms:
        return states.new_zeros((), dtype=torch.float32)
    return torch.stack(terms).mean()


def neighbour_record(weight: float, layer: int, span: int) -> dict:
    """The term's entries in a checkpoint's affix-training record (the task-suite trainer's and LoRA's alike)."""
    return {"affix_neighbours": weight, "affix_neighbour_layer": layer, "affix_neighbour_span": span}



def is_weight(value: object) -> bool:
    """``value`` is a finite number >= 0 (not a ``bool``): a loss term's weight."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0.0 <= value < math.inf


def is_whole(value: object, least: float) -> bool:
    """``value`` is an ``int`` (not a ``bool``) of at least ``least``."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


def apply_map(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)``; float32 maps beside a bfloat16 checkpoint take ``x`` in their dtype and give back the model's
    (under autocast the round trip changes nothing: the matmul runs in bfloat16 either way)."""
    dtype = next(lin.parameters()).dtype
    if x.dtype == dtype:
        return lin(x)
    return lin(x.to(dtype)).to(x.dtype)
