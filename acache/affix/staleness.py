"""How stale is an affix's cached K/V? Per layer, cosine similarity of its K and V computed alone
(positions 0..n-1, as the store keeps them) against computed in a request's full context."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from acache.affix.prompt import AffixPrompt
from acache.affix.store import AffixStore
from acache.decoding.canvas import build_canvas


@dataclass
class Staleness:
    key_cosine: list[float]  # per layer, mean over the request's affix tokens and KV heads
    value_cosine: list[float]
    affix_share: float  # affix tokens / all tokens of the canvas (generation region included)

    def safe_layers(self, tau: float) -> int:
        """Leading layers whose K and V both stay at or above ``tau`` (BiCache's safe shallow depth)."""
        count = 0
        for k, v in zip(self.key_cosine, self.value_cosine, strict=True):
            if min(k, v) < tau:
                break
            count += 1
        return count


@torch.inference_mode()
def measure_staleness(store: AffixStore, prompt: AffixPrompt, gen_length: int) -> Staleness:
    """Staleness of every affix of ``prompt`` on its all-mask canvas (the state anchors are chosen in)."""
    if not prompt.affixes:
        raise ValueError("the prompt has no affix to measure")
    model = store.model
    cfg = model.config
    canvas = build_canvas([prompt.layout], gen_length, cfg.mask_token_id, cfg.pad_token_id, model.device)
    full = model(canvas.tokens, canvas.positions, canvas.valid, return_kv=True).kv
    k_sum = torch.zeros(cfg.num_layers)
    v_sum = torch.zeros(cfg.num_layers)
    n = 0
    for span in prompt.affixes:
        entry = store.compute(prompt.affix_ids(span))
        c0 = canvas.column(0, span.start)
        for layer in range(cfg.num_layers):
            k_ctx = full.keys[layer][0, c0:c0 + span.length].float()
            v_ctx = full.values[layer][0, c0:c0 + span.length].float()
            k_sum[layer] += F.cosine_similarity(k_ctx, entry.keys[layer].float(), dim=-1).mean(-1).sum().cpu()
            v_sum[layer] += F.cosine_similarity(v_ctx, entry.values[layer].float(), dim=-1).mean(-1).sum().cpu()
        n += span.length
    share = n / canvas.total
    return Staleness((k_sum / n).tolist(), (v_sum / n).tolist(), share)
