"""Anchors chosen inside the first refresh (``anchor_pass="one"``): its edges are direct reuse and full
recomputation token for token, CacheBlend picks the anchors of its own pass, batches of mixed selectors,
ratios and lengths arriving apart decode as each request alone, and no probe forward runs."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from acache import reference
from acache.affix import one_pass
from acache.affix.store import AffixStore
from acache.models.layers import apply_rope
from acache.policies import ONE_PASS_SELECTORS
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.affix.helpers import affix_engine, affix_run, assert_each_as_alone, layouts

BASE = dict(gen_length=16, block_length=8, threshold=0.5)


@pytest.mark.parametrize("selector", ONE_PASS_SELECTORS)
def test_zero_ratio_is_direct_reuse(family_model, selector):
    """Ratio 0 takes no anchors: the request skips the selecting refresh and decodes as direct reuse, in every
    layout, alone and batched beside a request that does take anchors."""
    prompts = list(layouts().values())
    store = AffixStore(family_model)
    want = affix_run(family_model, prompts, SamplingParams(**BASE, selector="none"), store)
    zero = SamplingParams(**BASE, selector=selector, anchor_ratio=0.0, anchor_pass="one")
    got = affix_run(family_model, prompts, zero, store)
    mixed = affix_run(family_model, prompts, [zero, SamplingParams(**BASE, selector=selector, anchor_ratio=0.4),
                                              zero, zero], store, arrivals=[1, 0, 0, 2])
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g.token_ids == w.token_ids and g.anchors == []
        if i != 1:
            assert mixed[i].token_ids == w.token_ids and mixed[i].anchors == []
        assert reference_generate(family_model, prompts[i], zero, store).token_ids == w.token_ids


@pytest.mark.parametrize("ratio", [0.2, 0.3, 0.5])
@pytest.mark.parametrize("position", ["prefix", "infix", "suffix", "two-affix"])
def test_cacheblend_picks_its_own_pass_anchors(llada_model, position, ratio):
    """CacheBlend's published selection is a refresh's forward: one pass chooses the anchors the separate pass
    chooses."""
    prompt = layouts(affix_len=24)[position]
    store = AffixStore(llada_model)
    one = reference_generate(llada_model, prompt, SamplingParams(**BASE, selector="cacheblend",
                                                                 anchor_ratio=ratio), store)
    two = reference_generate(llada_model, prompt, SamplingParams(**BASE, selector="cacheblend",
                                                                 anchor_ratio=ratio, anchor_pass="two"), store)
    assert one.anchors == two.anchors and len(one.anchors) > 0


@pytest.mark.parametrize("far", [None, 0])
@pytest.mark.parametrize(("selector", "queries"), [("attention", "masks"), ("query-attention", "question")])
@pytest.mark.parametrize("position", ["prefix", "infix", "suffix", "two-affix"])
def test_first_filtering_scores_by_the_in_context_attention_mass(llada_model, position, selector, queries, far):
    """After layers 0-1, which run every column in context, the one-pass score is its definition: the attention of
    the counted queries (the masks', or the question's) on each affix token, softmax within the token's affix,
    summed over heads, queries and the two layers, here recomputed apart by a plain forward of the columns the
    refresh feeds (``far`` 0: the second block's masks are left out, of the forward and of the queries). A score
    read one column off (the affix after the masks in the suffix layout) fails it."""
    model, cfg = llada_model, llada_model.config
    seen = {}
    real_select, real_filter = reference.refresh_selecting, one_pass._filter

    def select(m, tokens, positions, valid, own, affix_slot, gen, *rest):
        seen.update(tokens=tokens, positions=positions, valid=valid, own=own, slot=affix_slot, gen=gen)
        return real_select(m, tokens, positions, valid, own, affix_slot, gen, *rest)

    def keep(affix_slot, cand, mass, deviation, counts, step):
        if step == 0:
            seen["mass"] = mass.clone()
        return real_filter(affix_slot, cand, mass, deviation, counts, step)

    params = SamplingParams(**BASE, selector=selector, anchor_ratio=0.2, anchor_pass="one", far_mask_window=far)
    with mock.patch.object(reference, "refresh_selecting", select), mock.patch.object(one_pass, "_filter", keep):
        reference_generate(model, layouts(affix_len=24)[position], params, AffixStore(model))
    fed = seen["valid"][0]
    slot = seen["slot"][0][fed]
    counted = (seen["gen"][0] if queries == "masks" else seen["own"][0] & ~seen["gen"][0] & (seen["slot"][0] < 0))[fed]
    positions = seen["positions"][:, fed]
    with torch.inference_mode():
        out = model.run_layers(model.embed(seen["tokens"][:, fed]), positions, None, None, range(2), return_kv=True,
                               capture_queries=True)
    rope = model.rope(positions)
    want = torch.zeros(slot.shape[0])
    for layer in range(2):
        q = apply_rope(out.queries[layer], *rope)[0, counted].float()
        k = apply_rope(out.kv.keys[layer], *rope)[0].float().repeat_interleave(cfg.num_heads // cfg.num_kv_heads, 1)
        for affix in range(int(slot.max()) + 1):
            member = slot == affix
            logits = torch.einsum("qhd,khd->hqk", q, k[member]) / cfg.head_dim ** 0.5
            want[member] += logits.softmax(-1).sum((0, 1))
    got = seen["mass"][0, fed]
    assert counted.any() and (slot >= 0).sum() >= 24 and bool(fed.all()) == (far is None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_pass_first_refresh_differs_from_the_two_pass_refresh(llada_model):
    """What one pass computes is not the two-pass refresh (its own columns saw more fresh affix K/V at the early
    layers), so the equalities above are not vacuous: over the layouts and ratios some tokens differ."""
    store = AffixStore(llada_model)
    differ = 0
    for prompt in layouts(affix_len=24).values():
        for ratio in (0.2, 0.5):
            runs = [reference_generate(llada_model, prompt, SamplingParams(
                **BASE, selector="cacheblend", anchor_ratio=ratio, anchor_pass=p), store) for p in ("one", "two")]
            differ += runs[0].token_ids != runs[1].token_ids
    assert differ > 0


def test_mixed_staggered_batch_matches_each_alone(family_model):
    """Every one-pass selector and two separate-pass ones, at different ratios and lengths, arriving apart:
    each request decodes, anchors included, as it would alone."""
    prompts = [*layouts().values(), *layouts(affix_len=14, question_len=9, seed=3).values()]
    params = [SamplingParams(**{**BASE, "gen_length": g}, selector=s, anchor_ratio=r, anchor_pass=p)
              for s, r, g, p in (("attention", 0.3, 16, None), ("cacheblend", 0.2, 8, None),
                                 ("query-attention", 0.5, 16, None), ("attention-deviation", 0.25, 24, None),
                                 ("cacheblend", 0.6, 16, "two"), ("kv-deviation", 0.3, 8, None),
                                 ("attention", 0.1, 24, "one"), ("cacheblend", 1.0, 16, None))]
    assert_each_as_alone(family_model, prompts, params, AffixStore(family_model), [3, 0, 1, 5, 0, 2, 4, 1])


@pytest.mark.parametrize("selector", ONE_PASS_SELECTORS)
def test_no_forward_besides_the_decoding_ones(llada_model, selector):
    """One pass runs each layer once a forward, and a forward is a decoding step (NFE): no probe, no
    selection pass. The separate pass of the same selector runs more."""
    calls = []
    hooks = [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in llada_model.layers]
    try:
        counts = {}
        prompt = layouts()["infix"]
        for anchor_pass in ("one", "two"):
            engine = affix_engine(llada_model)
            shared, _ = engine.affixes.acquire(prompt.affix_ids(prompt.affixes[0]))  # the affix's own forward
            engine.affixes.release(shared)
            calls.clear()
            params = SamplingParams(**BASE, selector=selector, anchor_ratio=0.3, anchor_pass=anchor_pass)
            (out,) = affix_run(llada_model, prompt, params, engine=engine)
            counts[anchor_pass] = (len(calls), out.nfe)
    finally:
        for hook in hooks:
            hook.remove()
    layers = len(llada_model.layers)
    assert counts["one"][0] == layers * counts["one"][1]
    assert counts["two"][0] > layers * counts["two"][1]
