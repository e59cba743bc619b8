"""Selectors that need no forward pass: direct reuse, full recompute, EPIC's first tokens, random."""

from __future__ import annotations

import torch

from acache.affix.selectors.base import AnchorSelector


class NoAnchors(AnchorSelector):
    """Direct reuse: no affix token is recomputed, whatever the ratio (its count is zero)."""

    name = "none"
    layout_only = True

    def row_scores(self, valid: torch.Tensor, seed: int) -> torch.Tensor:
        return torch.zeros(valid.shape, device=valid.device)


class AllAnchors(NoAnchors):
    """Full recompute: every affix token is recomputed, whatever the ratio (its count is the affix)."""

    name = "all"


class FirstK(AnchorSelector):
    """EPIC-style: the first tokens of each affix."""

    name = "first-k"
    layout_only = True

    def row_scores(self, valid: torch.Tensor, seed: int) -> torch.Tensor:
        return -torch.arange(valid.shape[0], device=valid.device, dtype=torch.float32)


class RandomAnchors(AnchorSelector):
    """Uniformly random affix tokens, drawn from each request's own seed (``ctx.row_seeds``) over its own
    tokens, so a request's anchors do not depend on its batch."""

    name = "random"
    layout_only = True

    def row_scores(self, valid: torch.Tensor, seed: int) -> torch.Tensor:
        """Drawn on the host (the same numbers on every device): one uniform number a valid column, in order."""
        on_host = valid.cpu()
        scores = torch.zeros(on_host.shape, dtype=torch.float32)
        scores[on_host] = torch.rand(int(on_host.sum()), generator=torch.Generator().manual_seed(seed))
        return scores.to(valid.device)
