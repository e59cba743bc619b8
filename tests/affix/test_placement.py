"""Affix K/V cached at positions 0..n-1 and placed at offset s attend exactly like K/V computed at s."""

from __future__ import annotations

import math

import pytest
import torch

from acache.affix.placement import place_affixes
from acache.affix.store import AffixStore
from acache.decoding.canvas import build_canvas
from acache.models.layers import apply_rope, rope_tables
from tests.affix.helpers import layouts
from tests.helpers import block_causal


@pytest.mark.parametrize("position", ["prefix", "infix", "suffix"])
def test_placed_keys_give_exact_attention_logits(family_model, position):
    model, cfg = family_model, family_model.config
    prompt = layouts(affix_len=12)[position]
    span = prompt.affixes[0]
    gen_length = 8
    canvas = build_canvas([prompt.layout], gen_length, cfg.mask_token_id, cfg.pad_token_id, model.device)
    entry = AffixStore(model).compute(prompt.affix_ids(span))
    kv, slot = place_affixes(model, canvas, [[(span.start, entry)]])
    cols = (slot[0] >= 0).nonzero().flatten()
    offset = int(canvas.positions[0, cols[0]])
    expected_offset = span.start + (gen_length if span.start >= prompt.gen_at else 0)
    assert offset == expected_offset and cols.numel() == span.length
    if block_causal(model) and offset % cfg.block_size:
        pytest.skip("a block-causal model's K/V move with their span only by whole attention blocks")
    # the same affix computed alone at its absolute positions s..s+n-1
    ids = torch.tensor([prompt.affix_ids(span)])
    pos = torch.arange(offset, offset + span.length)[None]
    at_s = model(ids, pos, return_kv=True).kv
    q = torch.randn(1, 5, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    q_pos = torch.tensor([[0, 3, offset, offset + 7, 40]])
    qr = apply_rope(q, *rope_tables(q_pos, cfg.head_dim, cfg.rope_theta))
    rep = cfg.num_heads // cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        placed = kv.keys[layer][:, cols]
        placed_r = apply_rope(placed, *rope_tables(kv.positions[:, cols], cfg.head_dim, cfg.rope_theta))
        direct_r = apply_rope(at_s.keys[layer], *rope_tables(pos, cfg.head_dim, cfg.rope_theta))
        got = torch.einsum("bmhd,bthd->bhmt", qr, placed_r.repeat_interleave(rep, 2)) / math.sqrt(cfg.head_dim)
        want = torch.einsum("bmhd,bthd->bhmt", qr, direct_r.repeat_interleave(rep, 2)) / math.sqrt(cfg.head_dim)
        assert torch.allclose(got, want, atol=1e-5)
        assert torch.allclose(kv.values[layer][:, cols], at_s.values[layer], atol=1e-5)
    # and placing at the wrong offset would be caught: rotating at 0..n-1 gives other logits
    wrong = apply_rope(kv.keys[0][:, cols], *rope_tables(torch.arange(span.length)[None], cfg.head_dim,
                                                         cfg.rope_theta))
    if offset:
        assert not torch.allclose(wrong, apply_rope(at_s.keys[0], *rope_tables(pos, cfg.head_dim, cfg.rope_theta)),
                                  atol=1e-3)


def test_placement_rejects_mismatched_tokens(llada_dir):
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    prompt = layouts()["prefix"]
    canvas = build_canvas([prompt.layout], 8, model.config.mask_token_id, model.config.pad_token_id, model.device)
    other = AffixStore(model).compute([1] * prompt.affixes[0].length, name="wrong")
    with pytest.raises(ValueError, match="does not match prompt 0"):
        place_affixes(model, canvas, [[(0, other)]])
