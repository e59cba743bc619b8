"""The project's second selector: where the request's own tokens would change the cached affix, propagated.

A cached affix token ``j`` never saw the request. In context, at layer ``l`` it also attends to the request's
own tokens (and to any other affix), so its attention output moves by

    ``inject_l(j) = sum_h || o_ctx(l, h, j) - o_alone(l, h, j) ||``

where ``o_ctx`` is softmax-weighted values over every column it sees in context (the probe's K/V where the
probe fed a column) and ``o_alone`` the cached computation: the cached K/V of its own affix only, by its place
in the affix (a block-causal model cached it in blocks counted from the affix's first token). A token that
reads a token already moved moves too, so the hidden state's deviation grows layer by layer through its
in-context attention on the affix, ``P_l`` (mean over heads):

    ``d_0 = 0``,  ``d_{l+1} = d_l + inject_l + P_l d_l``,  ``score(j) = sum_{l >= 1} d_l(j)``

a first-order estimate of what CacheBlend's oracle measures (the K/V deviation of every layer from the
one above layer 0, whose K/V are context-free) without running the affix in context. It needs the affix's
own queries (:meth:`SelectionContext.affix_queries`: question-free, the same for every request that shares
the affix) and the request's own K/V from the serving-path probe; the rest is attention arithmetic. Affix
columns every refresh recomputes anyway (``SelectionContext.own``) are never anchors, as for every selector.

It keeps its probe and the affix's own forward (no ``anchor_pass="one"``): its propagation reads the affix
tokens' queries alone and every layer's probe K/V before any anchor is known.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from acache.affix.context import SelectionContext, compact_index
from acache.affix.selectors.base import AnchorSelector, anchor_candidates, anchor_counts, keep_per_affix
from acache.models.layers import apply_rope, block_causal_mask


def context_kv(ctx: SelectionContext, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T, Hkv, D]`` pre-RoPE keys and values of every canvas column at ``layer``: the cached affix K/V
    where the probe did not feed, the probe's own K/V where it did."""
    out, fed, fed_valid = ctx.probe(with_kv=True)
    t = ctx.canvas.total
    keys, values = ctx.kv.keys[layer].clone(), ctx.kv.values[layer].clone()
    index = torch.where(fed_valid, fed, t)[:, :, None, None].expand_as(out.kv.keys[layer])
    keys.scatter_(1, index, out.kv.keys[layer].to(keys.dtype))
    values.scatter_(1, index, out.kv.values[layer].to(values.dtype))
    return keys[:, :t].float(), values[:, :t].float()


def _moves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: tuple[torch.Tensor, torch.Tensor] | None,
           seen: torch.Tensor, alone: torch.Tensor, at: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of rows ``[b, ...]``: each affix query's ``inject`` (summed over this process's heads, ``[b, A]``)
    and its in-context attention on the affix columns ``at`` (summed over heads, ``[b, A, A]``). ``cached``: the
    K/V the cached computation read, where they differ from ``k, v`` (None: nowhere it could see)."""
    logits = torch.einsum("bahd,bthd->bhat", q, k) / math.sqrt(d)
    k_cached, v_cached = cached if cached is not None else (k, v)
    logits_cached = logits if cached is None else torch.einsum("bahd,bthd->bhat", q, k_cached) / math.sqrt(d)
    p_ctx = torch.softmax(logits.masked_fill(~seen[:, None], float("-inf")), -1)
    p_alone = torch.nan_to_num(torch.softmax(logits_cached.masked_fill(~alone[:, None], float("-inf")), -1))
    moved = (torch.einsum("bhat,bthd->bhad", p_ctx, v)
             - torch.einsum("bhat,bthd->bhad", p_alone, v_cached)).norm(dim=-1).sum(1)
    spread = p_ctx.gather(3, at[:, None, None, :].expand(-1, p_ctx.shape[1], at.shape[1], -1)).sum(1)
    return moved, spread


def affix_offsets(affix_slot: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: each affix column's place in its own affix (0 for its first token), as its cache was computed;
    0 outside affixes."""
    offsets = torch.zeros_like(affix_slot)
    for slot in range(int(affix_slot.max()) + 1 if affix_slot.numel() else 0):
        member = affix_slot == slot
        offsets = torch.where(member, member.long().cumsum(1) - 1, offsets)
    return offsets


class InfluenceAnchors(AnchorSelector):
    name = "influence"

    def select(self, ctx: SelectionContext, ratio: float | Sequence[float]) -> torch.Tensor:
        """The top scores of each affix, ties to the earlier column: tokens nothing reaches score exactly zero
        (a block-causal prefix affix, whole), and a batch must break those ties as the request alone does."""
        return keep_per_affix(ctx.affix_slot, self.scores(ctx), anchor_candidates(ctx),
                              anchor_counts(ctx, ratio, self.name))

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        c, model = ctx.canvas, ctx.model
        cfg = model.config
        t, d = c.total, cfg.head_dim
        affix = ctx.affix_mask & c.valid
        if not bool(affix.any()):
            return torch.zeros(c.tokens.shape, dtype=torch.float32, device=c.tokens.device)
        queries = ctx.affix_queries()
        cols, valid = compact_index(affix, fill=t)  # [B, A]: the affix columns, the query side
        at = cols.clamp_max(t - 1)
        slot_q = torch.where(valid, ctx.affix_slot.gather(1, at), -2)
        q_rope = model.rope(c.positions.gather(1, at))
        k_rope = model.rope(c.positions)
        seen = c.valid[:, None, :].expand(-1, at.shape[1], -1)  # [B, A, T]: what a token sees in context
        alone = slot_q[:, :, None] == ctx.affix_slot[:, None, :]  # what it saw when cached: its own affix,
        if cfg.block_size is not None:  # and, block-causal, by its place in the affix, where the cache put it
            seen = block_causal_mask(c.valid, c.positions.gather(1, at), c.positions, cfg.block_size)
            local = affix_offsets(ctx.affix_slot)
            alone = alone & block_causal_mask(affix, local.gather(1, at), local, cfg.block_size)
        tp = getattr(model, "tp", None)
        heads = cfg.num_heads * (tp.world_size if tp is not None else 1)  # a rank's config holds its share
        dev = torch.zeros(at.shape, dtype=torch.float32, device=at.device)
        total = torch.zeros_like(dev)
        # only where the probe recomputed an affix column does the cached computation read other K/V than context
        fresh_affix = ctx.own is not None and bool((ctx.own & ctx.affix_mask).any())
        for layer in range(cfg.num_layers - 1):  # d_1 .. d_{L-1}: what layer L-1 moves feeds no later K/V
            keys, values = context_kv(ctx, layer)
            rep = queries[layer].shape[2] // keys.shape[2]
            q = apply_rope(queries[layer].gather(1, at[:, :, None, None].expand(-1, -1, *queries[layer].shape[2:])),
                           *q_rope)
            k = apply_rope(keys, *k_rope).repeat_interleave(rep, dim=2)
            v = values.repeat_interleave(rep, dim=2)
            cached = None
            if fresh_affix:  # the cached computation read the cached K/V, also of affix columns the probe fed
                cached = (apply_rope(ctx.kv.keys[layer][:, :t].float(), *k_rope).repeat_interleave(rep, dim=2),
                          ctx.kv.values[layer][:, :t].float().repeat_interleave(rep, dim=2))
            rows = [_moves(q[r:r + 1], k[r:r + 1], v[r:r + 1], None if cached is None else
                           (cached[0][r:r + 1], cached[1][r:r + 1]), seen[r:r + 1], alone[r:r + 1], at[r:r + 1], d)
                    for r in range(at.shape[0])]  # a row at a time: [H, A, T], not [B, H, A, T]
            inject = model.reduce_heads(torch.cat([m for m, _ in rows]))
            spread = model.reduce_heads(torch.cat([p for _, p in rows])) / heads
            dev = (dev + inject + torch.bmm(spread * valid[:, None, :], dev[:, :, None])[..., 0]) * valid
            total += dev
        scores = torch.zeros(c.tokens.shape[0], t + 1, dtype=torch.float32, device=c.tokens.device)
        return scores.scatter_(1, cols, total * valid)[:, :t]
