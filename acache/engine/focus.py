"""FOCUS on the paged engine: an in-block step runs its first ``layers`` layers on the whole block, reads
from the last of them which masked tokens the block's queries attend to most, and runs the later layers on
those alone (the seed "FOCUS: DLLMs Know How to Tame Their Compute Bound": attention importance predicts
which tokens a step decodes). The block's other tokens stay in the key set of the later layers through
their K/V of the last refresh, as the dual cache serves everything outside the block. Only kept tokens get
proposals; the others cannot be committed this step.

Definitions, for one request and the last early layer ``l``: the importance of a fed token ``j`` is
``sum over heads h and valid fed queries i of softmax_s(q_{h,i} . k_{h,s} / sqrt(d))[j]``, the softmax over
every key the step attends to (the cached ones and the fed ones, RoPE applied); the kept tokens are the
``max(1, ceil(ratio x masked))`` masked tokens of highest importance (ties to the earlier column), and at
least as many as the commit rule commits this step (low-confidence's quota).
"""

from __future__ import annotations

import math

import torch

from acache.affix.context import compact_index
from acache.decoding.commit import commit_top_k
from acache.engine.page_pool import PagedKV, PagePool
from acache.models.base import DiffusionLM
from acache.models.kv import LayerView
from acache.models.layers import apply_rope


def attention_received(model: DiffusionLM, layer: int, queries: torch.Tensor, keys: torch.Tensor,
                       positions: torch.Tensor, valid: torch.Tensor, past: PagedKV) -> torch.Tensor:
    """``[B, F]``: the attention each fed token receives from the valid fed queries at ``layer`` (pre-RoPE
    ``queries``/``keys`` ``[B, F, H, D]`` of the fed tokens; ``past`` the cached keys, pre-RoPE in the pool or
    rotated in a block's kept set)."""
    cfg = model.config
    d = cfg.head_dim
    rep = cfg.num_heads // cfg.num_kv_heads
    key_ok = torch.cat((past.mask, valid), dim=1)
    if past.rotated:  # a block's kept key set: rotated already
        fed_rope = model.rope(positions)
        kr = torch.cat((past.keys[layer], apply_rope(keys, *fed_rope)), dim=1)
    else:
        fed_rope, key_rope = model.rope_pair(positions, torch.cat((past.positions, positions), dim=1))
        kr = apply_rope(torch.cat((past.keys[layer], keys), dim=1), *key_rope)
    qr = apply_rope(queries, *fed_rope).float()
    kr = kr.float().repeat_interleave(rep, dim=2)
    logits = torch.einsum("bihd,bshd->bhis", qr, kr) / math.sqrt(d)
    probs = torch.softmax(logits.masked_fill(~key_ok[:, None, None, :], float("-inf")), dim=-1)
    probs = probs * valid[:, None, :, None]
    received = probs[..., past.mask.shape[1]:].sum(dim=(1, 2))
    return model.reduce_heads(received)


def focus_tokens(importance: torch.Tensor, masked: torch.Tensor, ratios: torch.Tensor,
                 least: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, F]`` bool: per row, the ``max(1, least, ceil(ratio x masked))`` masked tokens of highest importance
    (``least``: what the row's commit rule commits this step at the fewest, a quota rule's quota). ``ratios`` must
    be float64 (the runner builds them so), and the product is taken a hair under, as anchor counts are
    (``anchor_count``): a float32 0.6 times 25 is 15.0000006, one token too many."""
    count = torch.ceil(ratios.double() * masked.sum(-1) * (1 - 1e-12)).long().clamp_min(1)
    if least is not None:
        count = torch.maximum(count, least)
    return commit_top_k(importance.masked_fill(~masked, float("-inf")), masked, count)


class _WithDropped:
    """A block's kept (rotated) key set plus the dropped block tokens' K/V of the last refresh, rotated here."""

    rotated = True

    def __init__(self, model: DiffusionLM, pool: PagePool, past, slots: torch.Tensor, positions: torch.Tensor,
                 valid: torch.Tensor) -> None:
        cos, sin = model.rope(positions)
        self.keys = LayerView(lambda i: torch.cat((past.keys[i], apply_rope(pool.keys[i][slots], cos, sin)), 1),
                              pool.num_layers)
        self.values = LayerView(lambda i: torch.cat((past.values[i], pool.values[i][slots]), 1), pool.num_layers)
        self.positions = torch.cat((past.positions, positions), 1)
        self.mask = torch.cat((past.mask, valid), 1)
        self.num_layers = pool.num_layers


@torch.inference_mode()
def focused_step(model: DiffusionLM, pool: PagePool, tokens: torch.Tensor, positions: torch.Tensor,
                 valid: torch.Tensor, fed_slots: torch.Tensor, past: PagedKV, masked: torch.Tensor,
                 ratios: torch.Tensor, layers: int, least: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One focused in-block step of the fed tokens ``[B, F]`` (``fed_slots``: where their K/V of the last
    refresh are). Returns the final-normed hidden states ``[B, F, hidden]`` (zero where not kept) and the
    kept tokens ``[B, F]``."""
    f = tokens.shape[1]
    early = model.run_layers(model.embed(tokens), positions, valid, past, range(0, layers), return_kv=True,
                             capture_queries=True)
    importance = attention_received(model, layers - 1, early.queries[-1], early.kv.keys[-1], positions, valid, past)
    kept = focus_tokens(importance, masked & valid, ratios, least)
    at, at_valid = compact_index(kept, fill=f)
    at = at.clamp_max(f - 1)
    dropped, dropped_valid = compact_index(valid & ~kept, fill=f)
    dropped = dropped.clamp_max(f - 1)
    cached = torch.where(dropped_valid, fed_slots.gather(1, dropped), torch.full_like(dropped, pool.trash_slot))
    dropped_pos = positions.gather(1, dropped)
    if past.rotated:
        later = _WithDropped(model, pool, past, cached, dropped_pos, dropped_valid)
    else:
        later = PagedKV(pool, torch.cat((past.slots, cached), 1), torch.cat((past.positions, dropped_pos), 1),
                        torch.cat((past.mask, dropped_valid), 1))
    width = early.hidden.shape[-1]
    late = model.run_layers(early.hidden.gather(1, at[..., None].expand(-1, -1, width)), positions.gather(1, at),
                            at_valid, later, range(layers, len(model.layers)))
    hidden = torch.zeros(tokens.shape[0], f + 1, width, dtype=early.hidden.dtype, device=tokens.device)
    into = torch.where(at_valid, at, torch.full_like(at, f))
    hidden.scatter_(1, into[..., None].expand(-1, -1, width), model.norm(late.hidden))
    return hidden[:, :f], kept
