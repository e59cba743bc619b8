"""The generation loop: cache policies, batching, stop tokens and sampling, token for token."""

from __future__ import annotations

import pytest
import torch

from acache.decoding.cache_policy import DualCache, PrefixCache
from acache.decoding.canvas import build_canvas
from acache.decoding.generate import generate, truncate_at_stop
from acache.sampling_params import SamplingParams
from tests.conftest import random_prompts

RULES = [dict(remasking="threshold", threshold=0.5), dict(remasking="low_confidence", steps=16),
         dict(remasking="factor", factor=1.5)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r["remasking"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cache_refreshed_every_step_matches_no_cache(family_model, cache, rule):
    prompts = random_prompts([7, 12, 3], seed=11)
    base = dict(gen_length=32, block_length=8, **rule)
    want = generate(family_model, prompts, SamplingParams(cache="none", **base))
    got = generate(family_model, prompts, SamplingParams(cache=cache, refresh_interval=1, **base))
    assert got.token_ids == want.token_ids
    assert got.stats.refreshes == got.stats.nfe


@pytest.mark.parametrize("policy_cls", [PrefixCache, DualCache])
def test_cached_step_equals_full_forward_on_same_canvas(family_model, policy_cls):
    """Right after a refresh, the partial forward through the cache reproduces the full forward's
    logits for the block, so every difference in decoding comes from stale K/V and nothing else."""
    model = family_model
    canvas = build_canvas(random_prompts([9, 5], seed=2), 24, model.config.mask_token_id,
                          model.config.pad_token_id, model.device)
    x = canvas.tokens.clone()
    x[:, 9:14] = torch.tensor([[5, 6, 7, 8, 9]])  # some committed tokens around the block
    start, end, total = 17, 25, x.shape[1]
    policy = policy_cls()
    full = policy.plan(0, start, end, total)
    out = model(x[:, full.cols], canvas.positions[:, full.cols], canvas.valid[:, full.cols], return_kv=True)
    policy.store(out.kv, full, start, end)
    part = policy.plan(1, start, end, total)
    assert part.cols.start == start and not part.refresh
    out2 = model(x[:, part.cols], canvas.positions[:, part.cols], canvas.valid[:, part.cols], past=part.past)
    want = model.logits(out.hidden, full.block)
    got = model.logits(out2.hidden, part.block)
    skip = 1 if model.shifted_logits else 0  # a shifted model's first block column is committed at refresh
    assert torch.allclose(got[:, skip:], want[:, skip:], atol=1e-4)


def test_caches_without_refresh_are_approximate(llada_dir):
    """Non-vacuity: stale K/V does change decoding on this model, so the equality above is earned."""
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    prompts = random_prompts([7, 12, 3], seed=11)
    runs = {c: generate(model, prompts, SamplingParams(gen_length=32, block_length=8, cache=c, threshold=0.5))
            for c in ("none", "prefix", "dual")}
    assert runs["dual"].token_ids != runs["none"].token_ids
    assert runs["dual"].stats.refreshes == 4 and runs["none"].stats.refreshes == 0


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", [dict(remasking="threshold", threshold=0.5),
                                  dict(remasking="low_confidence", steps=12)], ids=lambda r: r["remasking"])
def test_batch_matches_each_prompt_alone(family_model, cache, rule):
    prompts = random_prompts([4, 13, 8, 1], seed=5)
    params = SamplingParams(gen_length=24, block_length=8, cache=cache, **rule)
    batched = generate(family_model, prompts, params).token_ids
    alone = [generate(family_model, [p], params).token_ids[0] for p in prompts]
    assert batched == alone
    assert len({tuple(t) for t in alone}) > 1  # outputs depend on the prompt


def test_low_confidence_nfe_and_refreshes(family_model):
    params = SamplingParams(gen_length=32, block_length=8, remasking="low_confidence", steps=16, cache="dual")
    stats = generate(family_model, random_prompts([6]), params).stats
    assert stats.nfe == 16 and stats.refreshes == 4


def test_stop_token_truncates_output(family_model):
    prompts = random_prompts([6], seed=4)
    params = SamplingParams(gen_length=16, block_length=8, threshold=0.5)
    full = generate(family_model, prompts, params).token_ids[0]
    stop = full[5]
    first = full.index(stop)
    cut = generate(family_model, prompts, params, stop_token_ids=[stop]).token_ids[0]
    assert cut == full[:first]
    assert truncate_at_stop([1, 2, 3, 2], {2}) == [1]
    assert truncate_at_stop([1, 3], {2}) == [1, 3]


def test_sampling_is_seeded_per_request(family_model):
    prompts = random_prompts([5, 9], seed=8)
    params = SamplingParams(gen_length=16, block_length=8, temperature=1.0, threshold=0.5)

    def gens(*seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    a = generate(family_model, prompts, params, generators=gens(1, 2)).token_ids
    b = generate(family_model, prompts, params, generators=gens(1, 2)).token_ids
    alone = generate(family_model, prompts[1:], params, generators=gens(2)).token_ids
    other = generate(family_model, prompts, params, generators=gens(3, 4)).token_ids
    greedy = generate(family_model, prompts, SamplingParams(gen_length=16, block_length=8, threshold=0.5)).token_ids
    assert a == b and a[1] == alone[0]
    assert a != other and a != greedy


def test_prompt_too_long(family_model):
    too_long = [[1] * (family_model.config.max_position_embeddings - 10)]
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate(family_model, too_long, SamplingParams(gen_length=16, block_length=8))


def test_dream_without_cache_commits_like_plain_decoding(dream_dir):
    """No forced block-head commit without a cache: each step is the plain low-confidence rule."""
    from acache.decoding.commit import LowConfidence
    from acache.models.loader import load_model

    model = load_model(dream_dir)
    prompt = random_prompts([10], seed=9)[0]
    params = SamplingParams(gen_length=16, block_length=8, steps=16, remasking="low_confidence", cache="none")
    got = generate(model, [prompt], params).token_ids[0]
    mask = model.config.mask_token_id
    x = torch.tensor([prompt + [mask] * 16])
    pos = torch.arange(x.shape[1])[None]
    for b in range(2):
        s, e = 10 + 8 * b, 18 + 8 * b
        rule = LowConfidence(8)
        rule.begin_block((x[:, s:e] == mask).sum(-1))
        for step in range(8):
            masked = x[:, s:e] == mask
            logits = model.logits(model(x, pos).hidden)[:, s:e]
            logits[..., mask] = float("-inf")  # [MASK] is never proposed
            probs = torch.softmax(logits, -1)
            conf, x0 = probs.max(-1)
            commit = rule.select(torch.where(masked, conf, float("-inf")), masked, step)
            x[:, s:e] = torch.where(commit, x0, x[:, s:e])
    assert got == truncate_at_stop(x[0, 10:].tolist(), {model.config.eos_token_id})
    assert len(got) > 4


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_infill_row_with_nothing_before_the_region_is_batch_independent(family_model, cache):
    from acache.decoding.canvas import Layout

    layouts = [Layout(tuple(random_prompts([6], seed=1)[0]), 0), Layout(tuple(random_prompts([9], seed=2)[0]), 5),
               Layout(tuple(random_prompts([4], seed=3)[0]), 4)]
    params = SamplingParams(gen_length=16, block_length=8, cache=cache, threshold=0.5)
    batched = generate(family_model, layouts, params).token_ids
    assert batched == [generate(family_model, [lay], params).token_ids[0] for lay in layouts]


def test_sampling_noise_does_not_depend_on_batch_mates(family_model):
    """Rows finish blocks at different steps; a finished row must not draw noise meanwhile."""
    prompts = random_prompts([5, 9, 13], seed=8)
    params = SamplingParams(gen_length=16, block_length=8, temperature=1.0, threshold=0.05)
    for trial in range(3):
        gens = [torch.Generator().manual_seed(10 * trial + i) for i in range(3)]
        batched = generate(family_model, prompts, params, generators=gens).token_ids
        for i, p in enumerate(prompts):
            alone = generate(family_model, [p], params, generators=[torch.Generator().manual_seed(10 * trial + i)])
            assert alone.token_ids[0] == batched[i]
