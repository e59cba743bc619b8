"""CacheBlend's gradual filtering against a naive loop, its schedule, and its place in generation."""

from __future__ import annotations

import math

import pytest
import torch

from acache.affix.selectors import make_selector
from acache.affix.selectors.base import carried_counts
from acache.affix.store import AffixStore
from acache.models.kv import KVCache
from acache.models.loader import load_model
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.affix.helpers import affix_run, layouts, selection_context
from tests.conftest import tiny_checkpoint


@pytest.fixture(scope="module", params=["llada", "dream"])
def deep_model(request, tmp_path_factory):
    """Four layers, so that filtering runs over three stale layers."""
    return load_model(tiny_checkpoint(tmp_path_factory.mktemp(f"deep-{request.param}"), request.param, layers=4))


def naive_cacheblend(model, prompt, gen_length, ratio):
    """The definition, one request, plain Python lists: layer-1 deviation of every affix token in full
    context, then at each later layer only the carried tokens recomputed against the others' cached K/V."""
    cfg = model.config
    ids = list(prompt.token_ids[:prompt.gen_at]) + [cfg.mask_token_id] * gen_length + list(
        prompt.token_ids[prompt.gen_at:])
    t = len(ids)
    shift = {True: gen_length, False: 0}
    cached = {}  # column -> per-layer (K, V) of the affix computed alone
    for span in prompt.affixes:
        alone = model(torch.tensor([prompt.affix_ids(span)]), torch.arange(span.length)[None], return_kv=True).kv
        for n in range(span.length):
            col = span.start + n + shift[span.start >= prompt.gen_at]
            cached[col] = [(alone.keys[layer][0, n], alone.values[layer][0, n]) for layer in range(cfg.num_layers)]
    affix_cols = sorted(cached)
    groups = [[c for c in affix_cols if span.start + shift[span.start >= prompt.gen_at] <= c
               < span.end + shift[span.start >= prompt.gen_at]] for span in prompt.affixes]

    def dev(k, v, col, layer):
        ck, cv = cached[col][layer]
        return sum(float((k[h] - ck[h]).norm() + (v[h] - cv[h]).norm()) for h in range(k.shape[0]))

    def keep(devs, group, count):
        ranked = sorted((c for c in group if c in devs), key=lambda c: (-devs[c], c))
        return set(ranked[:count])

    out = model.run_layers(model.embed(torch.tensor([ids])), torch.arange(t)[None], None, None, range(0, 2),
                           return_kv=True)
    hidden = {c: out.hidden[0, c] for c in range(t)}
    devs = {c: dev(out.kv.keys[1][0, c], out.kv.values[1][0, c], c, 1) for c in affix_cols}
    steps = cfg.num_layers - 1
    plans = [carried_counts(math.ceil(ratio * len(g) - 1e-9), len(g), steps) for g in groups]
    carried = set().union(*(keep(devs, g, plan[0]) for g, plan in zip(groups, plans, strict=True)))
    for layer in range(2, cfg.num_layers):
        fed = [c for c in range(t) if c not in cached or c in carried]
        others = [c for c in affix_cols if c not in carried]
        past = KVCache([torch.stack([cached[c][i][0] for c in others])[None] if others else
                        torch.zeros(1, 0, cfg.num_kv_heads, cfg.head_dim) for i in range(cfg.num_layers)],
                       [torch.stack([cached[c][i][1] for c in others])[None] if others else
                        torch.zeros(1, 0, cfg.num_kv_heads, cfg.head_dim) for i in range(cfg.num_layers)],
                       torch.tensor([others]), torch.ones(1, len(others), dtype=torch.bool))
        step = model.run_layers(torch.stack([hidden[c] for c in fed])[None], torch.tensor([fed]), None, past,
                                range(layer, layer + 1), return_kv=True)
        for i, c in enumerate(fed):
            hidden[c] = step.hidden[0, i]
        devs = {c: dev(step.kv.keys[0][0, i], step.kv.values[0][0, i], c, layer) for i, c in enumerate(fed)
                if c in carried}
        carried = set().union(*(keep(devs, g, plan[layer - 1]) for g, plan in zip(groups, plans, strict=True)))
    return sorted(carried)


@pytest.mark.parametrize("position", ["prefix", "infix", "suffix", "two-affix"])
@pytest.mark.parametrize("ratio", [0.2, 0.35])
def test_gradual_filtering_matches_the_naive_loop(deep_model, position, ratio):
    prompt = layouts(affix_len=14, question_len=4)[position]
    with torch.inference_mode():
        got = make_selector("cacheblend").select(selection_context(deep_model, prompt, 6), ratio)[0]
        want = naive_cacheblend(deep_model, prompt, 6, ratio)
    assert got.nonzero().flatten().tolist() == want
    assert len(want) == sum(math.ceil(ratio * s.length - 1e-9) for s in prompt.affixes)


@pytest.mark.parametrize("ratios", [[0.2, 0.5, 0.1, 0.3], [0.5, 0.6, 0.5, 0.7], [0.4, 0.4, 0.9, 0.45]])
def test_a_batch_selects_as_each_request_alone(deep_model, ratios):
    """Rows of different lengths are padded on the left; the suffix row's last column is an affix token."""
    prompts = list(layouts(affix_len=14, question_len=4).values())
    store = AffixStore(deep_model)
    with torch.inference_mode():
        ctx = selection_context(deep_model, prompts, 6, store)
        batched = make_selector("cacheblend").select(ctx, ratios)
        for row, (p, r) in enumerate(zip(prompts, ratios, strict=True)):
            alone_ctx = selection_context(deep_model, p, 6, store)
            alone = make_selector("cacheblend").select(alone_ctx, r)[0]
            # rows are padded on the left in a batch: compare the anchors' positions
            assert ctx.canvas.positions[row][batched[row]].tolist() == alone_ctx.canvas.positions[0][alone].tolist()


def test_the_schedule_shrinks_to_the_anchor_count():
    assert carried_counts(3, 10, 3) == [6, 4, 3]
    assert carried_counts(3, 4, 3) == [4, 4, 3]
    assert carried_counts(2, 20, 1) == [2]
    assert carried_counts(5, 5, 4) == [5, 5, 5, 5]
    assert carried_counts(0, 9, 3) == [0, 0, 0]
    # at a depth below 1 the same descent over the first ceil(depth * steps) steps, then the anchors alone
    assert carried_counts(3, 10, 3, depth=1.0) == [6, 4, 3]
    assert carried_counts(3, 10, 6, depth=0.5) == [6, 4, 3, 3, 3, 3]
    assert carried_counts(4, 20, 9, depth=0.25) == [8, 6, 4, 4, 4, 4, 4, 4, 4]
    assert carried_counts(3, 10, 5, depth=0.01) == [3, 3, 3, 3, 3]


@pytest.mark.parametrize("position", ["prefix", "suffix", "two-affix"])
def test_ratio_one_is_full_recomputation_and_generation_matches_the_reference(deep_model, position):
    prompt = layouts()[position]
    base = dict(gen_length=16, block_length=8, threshold=0.5)
    want = affix_run(deep_model, prompt, SamplingParams(cache="dual", **base))
    (got,) = affix_run(deep_model, prompt, SamplingParams(**base, selector="cacheblend", anchor_ratio=1.0))
    assert got.token_ids == want[0].token_ids
    params = SamplingParams(**base, selector="cacheblend", anchor_ratio=0.25)
    store = AffixStore(deep_model)
    (engine,) = affix_run(deep_model, prompt, params, store)
    alone = reference_generate(deep_model, prompt, params, store)
    assert engine.token_ids == alone.token_ids and engine.anchors == alone.anchors
