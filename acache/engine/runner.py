"""Batched forwards through the slot maps: selection probes, refreshes and in-block steps.

Every forward is ``gather + scaled-dot-product attention``: each request's key set is read from the
pool through its slot map (shared affix slots and its private slots), padded to the batch's longest,
and attended with one softmax over all keys. Fresh K/V of a refresh go to the request's private slots;
shared pages are never written.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from acache.affix.context import SelectionContext, request_seed
from acache.affix.policy import place_affixes
from acache.affix.selectors import make_selector
from acache.decoding.canvas import build_canvas
from acache.decoding.sampler import propose
from acache.engine.page_pool import PagedKV, PagePool
from acache.engine.sequence import Phase, Sequence
from acache.models.base import DiffusionLM


def _pad(rows: list[torch.Tensor], fill: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((r.numel() for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=torch.long, device=device)
    valid = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
        valid[i, :r.numel()] = True
    return out, valid


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    def __init__(self, model: DiffusionLM, pool: PagePool) -> None:
        self.model = model
        self.pool = pool
        self.device = model.device

    # -- anchor selection -------------------------------------------------------------------------
    @torch.inference_mode()
    def select(self, seqs: list[Sequence]) -> float:
        """Chooses anchors for a batch of requests with the same selector code as the single-request
        path, on a padded canvas holding their shared affix K/V; returns the time it took."""
        _sync(self.device)
        t0 = time.perf_counter()
        by_selector: dict[tuple[str, str], list[Sequence]] = {}
        for seq in seqs:
            by_selector.setdefault((seq.params.affix_policy, seq.params.anchor_query), []).append(seq)
        cfg = self.model.config
        for (name, query), group in by_selector.items():
            ratio = group[0].params.anchor_ratio
            canvas = build_canvas([s.prompt.layout for s in group], group[0].params.gen_length, cfg.mask_token_id,
                                  cfg.pad_token_id, self.device)
            placements = [[(s.prompt.affixes[i].start, a.entry(self.pool)) for i, a in s.affixes]
                          for s in group]
            kv, slot = place_affixes(self.model, canvas, placements)
            seeds = [request_seed(s.params.seed, s.prompt.token_ids) for s in group]
            anchors = make_selector(name, query).select(SelectionContext(self.model, canvas, slot, kv, seeds), ratio)
            for row, seq in enumerate(group):
                pad = canvas.pad_left[row]
                seq.set_anchors(anchors[row, pad:pad + seq.length] & (slot[row, pad:pad + seq.length] >= 0))
        _sync(self.device)
        return time.perf_counter() - t0

    # -- refresh and in-block steps ---------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], phase: Phase) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One batched forward of ``phase`` for ``seqs``; returns proposed tokens and confidences of each
        request's current block ``[B, L]`` and the forward's wall time."""
        dev = self.device
        trash = self.pool.trash_slot
        fed_cols, past_cols, block_index = [], [], []
        for seq in seqs:
            start, end = seq.block_cols
            cols = torch.arange(seq.length, device=dev)
            if phase is Phase.REFRESH:
                fed = cols[seq.recompute]
                past = cols[~seq.recompute]
                block_index.append(torch.searchsorted(fed, cols[start:end]))
            else:
                fed = cols[start:end]
                past = torch.cat((cols[:start], cols[end:]))
                block_index.append(torch.arange(end - start, device=dev))
            fed_cols.append(fed)
            past_cols.append(past)
        fed, fed_valid = _pad(fed_cols, 0, dev)
        past, past_valid = _pad(past_cols, 0, dev)
        rows = torch.arange(len(seqs), device=dev)[:, None]
        width = max(s.length for s in seqs)
        tokens = torch.stack([F.pad(s.tokens, (0, width - s.length)) for s in seqs])
        positions = torch.stack([F.pad(s.positions, (0, width - s.length)) for s in seqs])
        slot_maps = torch.stack([F.pad(s.slot_map, (0, width - s.length), value=trash) for s in seqs])
        past_slots = torch.where(past_valid, slot_maps[rows, past], torch.full_like(past, trash))
        paged = PagedKV(self.pool, past_slots, positions[rows, past], past_valid) if past.shape[1] else None
        _sync(dev)
        t0 = time.perf_counter()
        out = self.model(tokens[rows, fed], positions[rows, fed], fed_valid, past=paged,
                         return_kv=phase is Phase.REFRESH)
        if phase is Phase.REFRESH:
            write = torch.where(fed_valid, slot_maps[rows, fed], torch.full_like(fed, trash))
            self.pool.write(write, out.kv.keys, out.kv.values)
        logits = self.model.logits(out.hidden, torch.stack(block_index))
        _sync(dev)
        elapsed = time.perf_counter() - t0
        x0 = torch.empty(logits.shape[:2], dtype=torch.long, device=dev)
        conf = torch.empty(logits.shape[:2], dtype=torch.float32, device=dev)
        for i, seq in enumerate(seqs):
            gens = [seq.generator] if seq.params.temperature > 0 else None
            x0[i:i + 1], conf[i:i + 1] = propose(logits[i:i + 1], seq.params.temperature, gens,
                                                 mask_token_id=seq.mask_token_id)
        return x0, conf, elapsed
