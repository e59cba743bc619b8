"""The bridge term: a two-hop question's first hop named at a layer, so that the second has depth left to run.

Under direct reuse the two-affix demonstrations (``codes``: ``[demonstrations][story][question][GEN]``, each affix
computed alone) ask the answer column to find the object's holder in the story, then the holder's code in the
demonstrations. Neither cached span can do a hop for it, so both run at the answer column, one after the other,
inside the model's depth; trained on the answer alone, no run of the four-layer affix model learned it (it answers a
code of someone in the story, rarely the holder's: docs/accuracy.md, "A nineteenth run"). The term asks the answer
column's state at the output of one layer to name the first hop's result (the holder), through a training-only map
and the model's own final norm and output embedding, as the neighbour term (:mod:`acache_lab.train.neighbours`)
names an affix token's neighbours. The label comes from the task generator (``Example.bridge``): it is a curriculum
device of the synthetic suite, like its warm-up tasks, not an objective a released checkpoint's data can supply.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from acache.models.base import DiffusionLM
from acache_lab.train.neighbours import apply_map


class Bridge(NamedTuple):
    """What :func:`~acache_lab.train.trainer.masked_diffusion_loss` needs for the bridge term: its ``weight``, the
    training-only ``head`` (a ``hidden x hidden`` map), the ``layer`` whose output states it reads and ``targets
    [B]``, each row's first-hop token (-1 on rows without one, and on rows not isolated)."""

    weight: float
    head: nn.Module
    layer: int
    targets: torch.Tensor


def bridge_head(hidden_size: int) -> nn.Linear:
    """The term's map, starting as the identity: the state is read as the final norm and output embedding read the
    last layer's."""
    head = nn.Linear(hidden_size, hidden_size, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(hidden_size))
    return head


def bridge_loss(model: DiffusionLM, head: nn.Module, states: torch.Tensor, targets: torch.Tensor,
                columns: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``targets [B]`` predicted from ``states [B, T, hidden]`` at each row's ``columns [B]`` (its
    first answer column), on the rows with a target whose column is masked in ``masked [B, T]`` (a visible answer
    would give the hop away); zero when no row has one."""
    rows = torch.arange(len(targets), device=states.device)
    keep = (targets >= 0) & masked[rows, columns]
    if not bool(keep.any()):
        return states.new_zeros((), dtype=torch.float32)
    mapped = apply_map(head, states[rows[keep], columns[keep]])
    return F.cross_entropy(model.unembed(model.norm(mapped)).float(), targets[keep])
