"""FOCUS (``focus_layers``/``focus_ratio``): one focused step against its definition computed naively on a
hand-built pool; the engine's focused requests batched with others equal to each run alone; refusals."""

from __future__ import annotations

import math

import pytest
import torch

from acache.engine import EngineConfig, LLMEngine
from acache.engine.focus import focused_step
from acache.engine.page_pool import PagedKV, PagePool
from acache.models.kv import KVCache
from acache.models.layers import apply_rope, rope_tables
from acache.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.helpers import run_engine, tokens

MASK = 3


def hand_built(model, seed=0):
    """Two rows: 6 and 4 cached keys, blocks of 5 and 4 fed tokens (some masked), K/V of every slot random."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    pool = PagePool(cfg, 8, 4, torch.float32, torch.device("cpu"))
    for layer in range(cfg.num_layers):
        pool.keys[layer].copy_(torch.randn(pool.keys[layer].shape, generator=g))
        pool.values[layer].copy_(torch.randn(pool.values[layer].shape, generator=g))
    past_slots = torch.tensor([[0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 32, 32]])
    past_pos = torch.tensor([[0, 1, 2, 3, 4, 10], [0, 1, 2, 3, 0, 0]])
    past_valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    tokens = torch.tensor([[MASK, 7, MASK, MASK, MASK], [9, MASK, MASK, MASK, 0]])
    positions = torch.tensor([[5, 6, 7, 8, 9], [4, 5, 6, 7, 0]])
    valid = torch.tensor([[True] * 5, [True] * 4 + [False]])
    fed_slots = torch.tensor([[16, 17, 18, 19, 20], [24, 25, 26, 27, 32]])
    return pool, PagedKV(pool, past_slots, past_pos, past_valid), tokens, positions, valid, fed_slots


def naive_focus(model, pool, past, tokens, positions, valid, fed_slots, ratios, layers):
    """The definition, one row, head and query at a time."""
    cfg = model.config
    d, rep = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    kept_all, hidden_all = [], []
    for b in range(tokens.shape[0]):
        n = int(valid[b].sum())
        toks, pos = tokens[b, :n][None], positions[b, :n][None]
        ps = past.slots[b][past.mask[b]]
        pp = past.positions[b][past.mask[b]][None]
        dense = KVCache([k[ps][None] for k in pool.keys], [v[ps][None] for v in pool.values], pp,
                        torch.ones_like(pp, dtype=torch.bool))
        early = model.run_layers(model.embed(toks), pos, None, dense, range(0, layers), return_kv=True,
                                 capture_queries=True)
        q = apply_rope(early.queries[-1], *rope_tables(pos, d, cfg.rope_theta))[0]
        keys = torch.cat((pool.keys[layers - 1][ps][None], early.kv.keys[-1]), 1)
        keys = apply_rope(keys, *rope_tables(torch.cat((pp, pos), 1), d, cfg.rope_theta))[0]
        importance = [0.0] * n
        for h in range(cfg.num_heads):
            for i in range(n):
                logits = [float(q[i, h] @ keys[s, h // rep]) / math.sqrt(d) for s in range(keys.shape[0])]
                top = max(logits)
                z = sum(math.exp(x - top) for x in logits)
                for j in range(n):
                    importance[j] += math.exp(logits[len(ps) + j] - top) / z
        masked = [j for j in range(n) if int(toks[0, j]) == MASK]
        count = max(1, math.ceil(float(ratios[b]) * len(masked) * (1 - 1e-12)))
        kept = sorted(sorted(masked, key=lambda j: (-importance[j], j))[:count])
        dropped = [j for j in range(n) if j not in kept]
        ls = torch.cat((ps, fed_slots[b, dropped]))
        lp = torch.cat((pp[0], pos[0, dropped]))[None]
        later = KVCache([k[ls][None] for k in pool.keys], [v[ls][None] for v in pool.values], lp,
                        torch.ones_like(lp, dtype=torch.bool))
        late = model.run_layers(early.hidden[:, kept], pos[:, kept], None, later, range(layers, cfg.num_layers))
        kept_all.append(kept)
        hidden_all.append(model.norm(late.hidden)[0])
    return kept_all, hidden_all


@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0])
def test_a_focused_step_is_its_definition(llada_model, ratio):
    model = llada_model
    pool, past, tokens, positions, valid, fed_slots = hand_built(model)
    masked = (tokens == MASK) & valid
    ratios = torch.tensor([ratio, ratio], dtype=torch.float64)
    hidden, kept = focused_step(model, pool, tokens, positions, valid, fed_slots, past, masked, ratios, 1)
    want_kept, want_hidden = naive_focus(model, pool, past, tokens, positions, valid, fed_slots, ratios, 1)
    for b in range(2):
        got = torch.nonzero(kept[b]).flatten().tolist()
        assert got == want_kept[b]
        assert torch.allclose(hidden[b, got], want_hidden[b], atol=1e-5)
        assert not bool(hidden[b, ~kept[b]].any())
    assert [len(k) for k in want_kept] == [max(1, math.ceil(ratio * 4)), max(1, math.ceil(ratio * 3))]


def test_focused_requests_batched_with_others_equal_each_alone(llada_model):
    prompts = random_prompts([7, 12, 3, 9], seed=5)
    rules = [dict(threshold=0.5), dict(threshold=0.5), dict(remasking="low_confidence", steps=8), dict(threshold=0.7)]
    params = [SamplingParams(gen_length=(16, 32)[i % 2], block_length=8, focus_layers=(1, None, 1, 1)[i],
                             focus_ratio=(0.25, 0.25, 0.1, 1.0)[i], **rules[i]) for i in range(4)]
    config = dict(page_size=4, kv_cache_memory=1 << 22)
    batched = run_engine(llada_model, prompts, params, arrivals=[0, 0, 2, 5],
                         engine=LLMEngine(llada_model, EngineConfig(max_num_seqs=4, **config)))
    mask = llada_model.config.mask_token_id
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        assert mask not in out.token_ids and len(out.token_ids) == p.gen_length  # every column committed, never a mask
        alone = run_engine(llada_model, [prompt], [p], engine=LLMEngine(llada_model, EngineConfig(**config)))
        assert out.token_ids == alone[0].token_ids
    plain = run_engine(llada_model, prompts, [SamplingParams(gen_length=p.gen_length, block_length=8, **rules[i])
                                              for i, p in enumerate(params)])
    assert tokens(batched) != tokens(plain)  # non-vacuity: FOCUS does change decoding on this model
    assert batched[0].nfe >= plain[0].nfe  # fewer tokens proposed a step: never fewer steps


def test_focus_is_refused_where_it_cannot_hold(dream_dir):
    from acache.models.loader import load_model

    engine = LLMEngine(load_model(dream_dir), EngineConfig(kv_cache_memory=1 << 20))
    with pytest.raises(ValueError, match="focus_layers is not supported for dream"):
        engine.add_request([1, 2, 3], SamplingParams(gen_length=8, block_length=8, focus_layers=1))
    with pytest.raises(ValueError, match="not 'factor'"):
        SamplingParams(focus_layers=1, remasking="factor")


def test_focus_past_the_models_layers_is_refused(llada_model):
    """focus_layers at or past the model's depth focused nothing and said nothing."""
    engine = LLMEngine(llada_model, EngineConfig(kv_cache_memory=1 << 22))
    layers = len(llada_model.layers)
    for focus in (layers, 100):
        with pytest.raises(ValueError, match=f"focus_layers \\({focus}\\) .* below the model's {layers} layers"):
            engine.add_request([1, 2, 3], SamplingParams(gen_length=8, block_length=8, focus_layers=focus))


@pytest.mark.parametrize("ratio, masked, want", [(0.6, 25, 15), (0.3, 50, 15), (0.54, 50, 27), (0.25, 32, 8),
                                                 (0.01, 5, 1), (1.0, 7, 7)])
def test_focus_keeps_the_ceiling_of_ratio_times_masked_exactly(ratio, masked, want):
    """The count is ceil(ratio x masked) as anchor counts are: in float32 0.6 x 25 is 15.0000006, and 16 were kept
    (the engine builds the ratios in float64, as focus_tokens needs them)."""
    from acache.engine.focus import focus_tokens

    importance = torch.arange(masked, dtype=torch.float32).flip(0)[None]
    mask = torch.ones(1, masked, dtype=torch.bool)
    assert int(focus_tokens(importance, mask, torch.tensor([ratio], dtype=torch.float64)).sum()) == want
    assert math.ceil(ratio * masked * (1 - 1e-12)) == want
