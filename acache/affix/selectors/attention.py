"""Attention-based selectors: ACache's own, and the ProphetKV-style question-attention baseline."""

from __future__ import annotations

import torch

from acache.affix.context import SelectionContext
from acache.affix.selectors.base import AnchorSelector, OnePass
from acache.policies import ANCHOR_QUERIES as QUERY_SOURCES


class AttentionAnchors(AnchorSelector):
    """ACache: the affix tokens the masked generation region attends to most (DESIGN §4.3).

    ``query="probe"`` takes the masks' queries from the serving-path probe (non-affix tokens against
    the stale shared affix K/V); ``query="full"`` from a no-cache forward of the whole request;
    ``query="shallow"`` from the probe's first layers only (``shallow_layers``): the same score over
    fewer layers, at that share of the probe's cost.

    One pass (``anchor_pass="one"``, the default with the probe's queries): inside the first refresh, the masks'
    queries of that forward on the affix keys it attends to, summed over the layers so far, filter the
    candidates layer by layer (:mod:`acache.affix.one_pass` says where this differs from the probe's score).
    """

    name = "attention"
    one_pass = OnePass(queries="masks")

    def __init__(self, query: str = "probe") -> None:
        if query not in QUERY_SOURCES:
            raise ValueError(f"anchor query source must be one of {', '.join(QUERY_SOURCES)}, got {query!r}")
        self.query = query

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        gen, t = ctx.gen_mask, ctx.canvas.total
        if self.query == "full":
            cols = torch.arange(t, device=gen.device).expand_as(gen)
            return ctx.attention_mass(ctx.full().queries, cols, gen & ctx.canvas.valid)
        if self.query == "shallow":
            queries, fed, fed_valid = ctx.shallow_probe()
        else:
            out, fed, fed_valid = ctx.probe()
            queries = out.queries
        at = fed.clamp_max(t - 1)
        return ctx.attention_mass(queries, at, gen.gather(1, at) & fed_valid)


class QueryAttentionAnchors(AnchorSelector):
    """ProphetKV-style: the affix tokens the prompt's own non-affix, non-mask tokens attend to most.

    A request with no such token scores every affix token zero, which degrades to the first tokens. One pass:
    the question's queries inside the first refresh, as ``attention``'s masks (:mod:`acache.affix.one_pass`).
    """

    name = "query-attention"
    one_pass = OnePass(queries="question")

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        out, fed, fed_valid = ctx.probe()
        t = ctx.canvas.total
        question = (~ctx.gen_mask & ~ctx.affix_mask).gather(1, fed.clamp_max(t - 1)) & fed_valid
        return ctx.attention_mass(out.queries, fed.clamp_max(t - 1), question)
