"""The forward pass over an explicit key set: cached pre-RoPE K/V at absolute positions plus fresh K/V."""

from __future__ import annotations

import pytest
import torch

from acache.models.kv import KVCache
from acache.models.layers import apply_rope
from tests.conftest import DEVICE, random_prompts


def _hidden(model, ids, positions=None, mask=None, past=None, return_kv=False):
    ids = torch.as_tensor(ids)
    positions = torch.arange(ids.shape[1]).expand_as(ids) if positions is None else positions
    return model(ids, positions, mask, past=past, return_kv=return_kv)


def test_subset_of_queries_against_shuffled_cache(family_model):
    """Any subset of positions, fed with the rest as cached K/V in any order, gives the full-forward states."""
    model = family_model
    ids = torch.tensor(random_prompts([24, 24], seed=3))
    full = _hidden(model, ids, return_kv=True)
    gen = torch.Generator().manual_seed(0)
    fed = torch.tensor([2, 3, 9, 10, 11, 17])
    rest = torch.tensor([c for c in range(24) if c not in set(fed.tolist())])
    perm = torch.stack([rest[torch.randperm(len(rest), generator=gen)] for _ in range(2)])
    past = full.kv.gather(perm)
    part = _hidden(model, ids[:, fed], positions=torch.arange(24)[fed].expand(2, -1), past=past)
    assert torch.allclose(part.hidden, full.hidden[:, fed], atol=1e-5)


def test_cached_keys_are_pre_rope(family_model):
    """K cached at positions 0.. and attended at an offset equals K computed at that offset."""
    model = family_model
    ids = torch.tensor(random_prompts([10], seed=5))
    at_zero = _hidden(model, ids, return_kv=True).kv
    at_offset = _hidden(model, ids, positions=torch.arange(32, 42)[None], return_kv=True).kv
    # Within one span, attention depends only on relative positions, so pre-RoPE K/V are the same wherever the
    # span sits (for a block-causal model: wherever its blocks fall alike, as at this offset of 8 blocks of 4).
    for k0, k1 in zip(at_zero.keys, at_offset.keys, strict=True):
        assert torch.allclose(k0, k1, atol=1e-5)


def test_padding_is_never_attended(family_model):
    model = family_model
    ids = random_prompts([12], seed=7)[0]
    alone = _hidden(model, [ids])
    pads = [99, 98, 97, 96, 95]
    padded = torch.tensor([pads + ids])
    positions = torch.tensor([[0] * 5 + list(range(12))])
    mask = torch.tensor([[False] * 5 + [True] * 12])
    out = _hidden(model, padded, positions=positions, mask=mask)
    assert torch.allclose(out.hidden[:, 5:], alone.hidden, atol=1e-5)
    unmasked = _hidden(model, padded, positions=positions)
    assert not torch.allclose(unmasked.hidden[:, 5:], alone.hidden, atol=1e-3)


def test_dream_logits_are_shifted(dream_dir):
    from acache.models.loader import load_model

    model = load_model(dream_dir)
    out = _hidden(model, random_prompts([8], seed=1))
    logits = model.logits(out.hidden)
    direct = torch.nn.functional.linear(out.hidden, model.lm_head.weight)
    assert torch.allclose(logits[:, 1:], direct[:, :-1], atol=1e-6)
    assert torch.allclose(logits[:, 0], direct[:, 0], atol=1e-6)
    assert torch.allclose(model.logits(out.hidden, slice(4, 7)), direct[:, 3:6], atol=1e-6)


def test_kvcache_shape_errors():
    k = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="positions"):
        KVCache([k], [k], torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key layers"):
        KVCache([k, k], [k], torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool))


def test_model_rejects_mismatched_inputs(family_model):
    with pytest.raises(ValueError, match="same shape"):
        family_model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))


def test_an_all_true_mask_is_dropped_and_changes_nothing():
    """Attention without a mask (every key valid) gives what the all-True mask gives, to the bit; a mask with
    one False key is kept."""
    from acache.models.layers import attend, dense_mask

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    full = torch.ones(2, 7, dtype=torch.bool)
    assert dense_mask(full) is None
    assert torch.equal(attend(q, k, v, None), attend(q, k, v, full))
    holed = full.clone()
    holed[1, 3] = False
    assert dense_mask(holed) is holed
    assert not torch.equal(attend(q, k, v, None)[1], attend(q, k, v, holed)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_rotate_half_bit_for_bit(dtype):
    """The two half-width updates give ``x * cos + rotate_half(x) * sin`` exactly (upstream's arithmetic, which the
    token-for-token equivalences rest on), with the same gradient in training."""
    from acache.models.layers import apply_rope, rope_tables

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 40, 3, 32, generator=gen) * 4).to(DEVICE, dtype).requires_grad_()
    cos, sin = rope_tables(torch.randint(0, 9000, (2, 40), generator=gen).to(DEVICE), 32, 10000.0)
    x32 = x.float()
    want = (x32 * cos + torch.cat((-x32[..., 16:], x32[..., :16]), dim=-1) * sin).to(dtype)
    got = apply_rope(x, cos, sin)
    assert torch.equal(got, want)
    (grad_want,) = torch.autograd.grad(want.float().square().sum(), x)
    (grad_got,) = torch.autograd.grad(got.float().square().sum(), x)
    assert torch.equal(grad_got, grad_want)


def test_model_rope_tables_are_rope_tables_bit_for_bit(family_model):
    """``model.rope`` (the frequencies made once per device, which the forward, the selectors and FOCUS read) gives
    :func:`rope_tables`'s values exactly, on a second call too, and ``rope_pair``'s query tables are the key tables'
    fed part."""
    from acache.models.layers import rope_tables

    cfg = family_model.config
    gen = torch.Generator().manual_seed(1)
    past, fed = (torch.randint(0, 900, (2, n), generator=gen).to(DEVICE) for n in (13, 7))
    for positions in (fed, past):
        want = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        for got in (family_model.rope(positions), family_model.rope(positions)):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    queries, keys = family_model.rope_pair(fed, torch.cat((past, fed), dim=1))
    assert all(torch.equal(q, w) for q, w in zip(queries, rope_tables(fed, cfg.head_dim, cfg.rope_theta), strict=True))
    assert all(torch.equal(k[:, :13], w) for k, w in zip(keys, rope_tables(past, cfg.head_dim, cfg.rope_theta),
                                                          strict=True))


def test_captured_rotated_tensors_are_what_attention_read(family_model):
    """``capture_rotated`` hands back each layer's rotated queries and the rotated keys it attended, the past's (in
    the order given, at their own positions) then the fed tokens': the same values as rotating the captured pre-RoPE
    ones, bit for bit, so a score of that attention (one-pass selection) need not rotate them again."""
    model = family_model
    ids = torch.tensor(random_prompts([20, 20], seed=11))
    full = _hidden(model, ids, return_kv=True)
    fed = torch.tensor([1, 4, 5, 12, 19])
    rest = torch.tensor([c for c in range(20) if c not in set(fed.tolist())])
    gen = torch.Generator().manual_seed(2)
    past = full.kv.gather(torch.stack([rest[torch.randperm(len(rest), generator=gen)] for _ in range(2)]))
    positions = fed.expand(2, -1)
    with torch.inference_mode():
        out = model.run_layers(model.embed(ids[:, fed]), positions, None, past, range(model.config.num_layers),
                               return_kv=True, capture_queries=True, capture_rotated=True)
    q_rope = model.rope(positions)
    k_rope = model.rope(torch.cat((past.positions, positions), 1))
    assert len(out.rotated) == model.config.num_layers
    for layer, (queries, keys) in enumerate(out.rotated):
        assert torch.equal(queries, apply_rope(out.queries[layer], *q_rope))
        assert torch.equal(keys, apply_rope(torch.cat((past.keys[layer], out.kv.keys[layer]), 1), *k_rope))
