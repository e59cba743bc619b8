"""Decoding on the engine and on the reference path: cache policies, batching, stop tokens and sampling,
token for token."""

from __future__ import annotations

import pytest
import torch

from acache.decoding.canvas import Layout
from acache.decoding.request_state import Phase, RequestState, truncate_at_stop
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.helpers import run_engine, tokens

RULES = [dict(remasking="threshold", threshold=0.5), dict(remasking="low_confidence", steps=16),
         dict(remasking="factor", factor=1.5)]


def alone(model, prompts, params, **kw):
    return [reference_generate(model, p, params, **kw).token_ids for p in prompts]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r["remasking"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cache_refreshed_every_step_matches_no_cache(family_model, cache, rule):
    """Three requests of other lengths and block sizes, arriving apart: refreshed at every step, each decodes as
    with no cache."""
    prompts = random_prompts([7, 12, 3], seed=11)
    shapes = [dict(gen_length=32, block_length=8), dict(gen_length=16, block_length=4),
              dict(gen_length=32, block_length=16)]
    want = run_engine(family_model, prompts, [SamplingParams(cache="none", **s, **rule) for s in shapes], [0, 2, 1])
    got = run_engine(family_model, prompts, [SamplingParams(cache=cache, refresh_interval=1, **s, **rule)
                                             for s in shapes], [1, 0, 3])
    assert tokens(got) == tokens(want)
    assert all(o.refreshes == o.nfe for o in got)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_step_equals_full_forward_on_same_canvas(family_model, cache):
    """Right after a refresh, the partial forward through the cache reproduces the full forward's
    logits for the block, so every difference in decoding comes from stale K/V and nothing else."""
    model = family_model
    state = RequestState(Layout(tuple(random_prompts([9], seed=2)[0]), 9),
                         SamplingParams(gen_length=24, block_length=8, cache=cache), model.config.mask_token_id,
                         model.config.pad_token_id, model.shifted_logits, model.device)
    state.admit()
    state.block = 1
    state.tokens[9:14] = torch.tensor([5, 6, 7, 8, 9])  # some committed tokens before the block
    full = state.plan()
    assert full.refresh and full.write and len(full.fed) == state.length
    x, pos = state.tokens[None], state.positions[None]
    out = model(x, pos, return_kv=True)
    state.phase = Phase.STEP
    part = state.plan()
    assert not part.refresh and part.fed[0] == state.block_cols[0]
    past = out.kv.columns(part.past)
    out2 = model(x[:, part.fed], pos[:, part.fed], past=past)
    want = model.logits(out.hidden, full.block[None])
    got = model.logits(out2.hidden, part.block[None])
    skip = 1 if model.shifted_logits else 0  # a shifted model's first block column is committed at refresh
    assert torch.allclose(got[:, skip:], want[:, skip:], atol=1e-4)


def test_caches_without_refresh_are_approximate(llada_dir):
    """Non-vacuity: stale K/V does change decoding on this model, so the equality above is earned."""
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    prompts = random_prompts([7, 12, 3], seed=11)
    runs = {c: run_engine(model, prompts, SamplingParams(gen_length=32, block_length=8, cache=c, threshold=0.5))
            for c in ("none", "prefix", "dual")}
    assert tokens(runs["dual"]) != tokens(runs["none"])
    assert runs["dual"][0].refreshes == 4 and runs["none"][0].refreshes == 0


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", [dict(remasking="threshold", threshold=0.5),
                                  dict(remasking="low_confidence", steps=12)], ids=lambda r: r["remasking"])
def test_batch_matches_each_prompt_alone(family_model, cache, rule):
    prompts = random_prompts([4, 13, 8, 1], seed=5)
    params = SamplingParams(gen_length=24, block_length=8, cache=cache, **rule)
    want = alone(family_model, prompts, params)
    assert tokens(run_engine(family_model, prompts, params)) == want
    assert tokens(run_engine(family_model, prompts, params, arrivals=[0, 3, 1, 7])) == want
    assert len({tuple(t) for t in want}) > 1  # outputs depend on the prompt


def test_mixed_parameters_in_one_batch_match_each_alone(family_model):
    prompts = random_prompts([4, 13, 8, 1, 6], seed=5)
    params = [SamplingParams(gen_length=8, block_length=8, threshold=0.5),
              SamplingParams(gen_length=32, block_length=4, cache="prefix", remasking="low_confidence", steps=16),
              SamplingParams(gen_length=16, block_length=16, cache="none", remasking="factor", factor=2.0),
              SamplingParams(gen_length=24, block_length=8, refresh_interval=3, threshold=0.7),
              SamplingParams(gen_length=16, block_length=8, temperature=0.8, seed=3)]
    want = [reference_generate(family_model, p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    assert tokens(run_engine(family_model, prompts, params, arrivals=[2, 0, 5, 1, 3])) == want


def test_low_confidence_nfe_and_refreshes(family_model):
    params = SamplingParams(gen_length=32, block_length=8, remasking="low_confidence", steps=16, cache="dual")
    out = run_engine(family_model, random_prompts([6]), params)[0]
    ref = reference_generate(family_model, random_prompts([6])[0], params)
    assert (out.nfe, out.refreshes) == (ref.nfe, ref.refreshes) == (16, 4)


def test_stop_token_truncates_output(family_model):
    prompts = random_prompts([6], seed=4)
    params = SamplingParams(gen_length=16, block_length=8, threshold=0.5)
    full = run_engine(family_model, prompts, params)[0].token_ids
    stop = full[5]
    first = full.index(stop)
    cut = run_engine(family_model, prompts, params, stop_token_ids=[stop])[0]
    assert cut.token_ids == full[:first] and cut.stopped
    per_request = run_engine(family_model, prompts, SamplingParams(gen_length=16, block_length=8, threshold=0.5,
                                                                   stop_token_ids=(stop,)))[0]
    assert per_request.token_ids == full[:first]
    assert truncate_at_stop([1, 2, 3, 2], {2}) == [1]
    assert truncate_at_stop([1, 3], {2}) == [1, 3]


def test_sampling_is_seeded_per_request(family_model):
    prompts = random_prompts([5, 9], seed=8)

    def params(seed):
        return SamplingParams(gen_length=16, block_length=8, temperature=1.0, threshold=0.5, seed=seed)

    a = tokens(run_engine(family_model, prompts, [params(1), params(2)]))
    b = tokens(run_engine(family_model, prompts, [params(1), params(2)]))
    one = run_engine(family_model, prompts[1:], [params(2)])[0].token_ids
    other = tokens(run_engine(family_model, prompts, [params(3), params(4)]))
    greedy = tokens(run_engine(family_model, prompts, SamplingParams(gen_length=16, block_length=8, threshold=0.5)))
    assert a == b and a[1] == one
    assert a != other and a != greedy
    assert a == [reference_generate(family_model, p, params(s)).token_ids for p, s in zip(prompts, (1, 2), strict=True)]


def test_prompt_too_long(family_model):
    too_long = [1] * (family_model.config.max_position_embeddings - 10)
    with pytest.raises(ValueError, match="exceed the context"):
        run_engine(family_model, [too_long], SamplingParams(gen_length=16, block_length=8))
    with pytest.raises(ValueError, match="exceed the context"):
        reference_generate(family_model, too_long, SamplingParams(gen_length=16, block_length=8))


def test_dream_without_cache_commits_like_plain_decoding(dream_dir):
    """No forced block-head commit without a cache: each step is the plain low-confidence rule, with the
    confidence taken from the softmax over the whole vocabulary (``[MASK]`` included)."""
    from acache.decoding.commit import LowConfidence
    from acache.models.loader import load_model

    model = load_model(dream_dir)
    prompt = random_prompts([10], seed=9)[0]
    params = SamplingParams(gen_length=16, block_length=8, steps=16, remasking="low_confidence", cache="none")
    got = run_engine(model, [prompt], params)[0].token_ids
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
            probs = torch.softmax(logits, -1)
            logits[..., mask] = float("-inf")  # [MASK] is never proposed
            x0 = logits.argmax(-1)
            conf = probs.gather(-1, x0[..., None])[..., 0]
            commit = rule.select(torch.where(masked, conf, float("-inf")), masked, step)
            x[:, s:e] = torch.where(commit, x0, x[:, s:e])
    assert got == truncate_at_stop(x[0, 10:].tolist(), {model.config.eos_token_id})
    assert len(got) > 4


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_infill_row_with_nothing_before_the_region_is_batch_independent(family_model, cache):
    layouts = [Layout(tuple(random_prompts([6], seed=1)[0]), 0), Layout(tuple(random_prompts([9], seed=2)[0]), 5),
               Layout(tuple(random_prompts([4], seed=3)[0]), 4)]
    from acache.affix.prompt import AffixPrompt

    prompts = [AffixPrompt(lay.token_ids, lay.gen_at) for lay in layouts]
    params = SamplingParams(gen_length=16, block_length=8, cache=cache, threshold=0.5)
    assert tokens(run_engine(family_model, prompts, params)) == alone(family_model, prompts, params)


def test_sampling_noise_does_not_depend_on_batch_mates(family_model):
    """Requests finish blocks at different steps; one that is not stepped must not draw noise meanwhile."""
    prompts = random_prompts([5, 9, 13], seed=8)
    for trial in range(3):
        params = [SamplingParams(gen_length=16, block_length=8, temperature=1.0, threshold=0.05, seed=10 * trial + i)
                  for i in range(3)]
        batched = tokens(run_engine(family_model, prompts, params, arrivals=[0, trial, 2 * trial]))
        assert batched == [reference_generate(family_model, p, sp).token_ids
                           for p, sp in zip(prompts, params, strict=True)]


def test_a_block_holding_a_stop_token_ends_the_request(family_model):
    """The output is cut at the first stop token, so the blocks after the one that holds it are never decoded:
    the same tokens for fewer forwards, on the engine and on the reference path alike."""
    prompt = random_prompts([6], seed=4)[0]
    params = SamplingParams(gen_length=32, block_length=8, threshold=0.5)
    full = run_engine(family_model, [prompt], params)[0]
    assert full.refreshes == 4
    stop = full.token_ids[2]  # in the first block
    first = full.token_ids.index(stop)
    stopping = SamplingParams(gen_length=32, block_length=8, threshold=0.5, stop_token_ids=(stop,))
    cut = run_engine(family_model, [prompt], stopping)[0]
    ref = reference_generate(family_model, prompt, stopping)
    assert cut.token_ids == ref.token_ids == full.token_ids[:first] and cut.stopped
    assert cut.refreshes == ref.refreshes == 1 and cut.nfe == ref.nfe < full.nfe


def test_admission_fixes_the_recompute_set_once_and_refuses_a_mixed_call():
    """RequestState.admit is the one way out of SELECT: no shared columns (every column own), given anchors,
    or anchors chosen inside the first refresh; a second call, or anchors without their shared columns, is
    refused by name."""
    def fresh():
        return RequestState(Layout((1, 2, 3, 4), 4), SamplingParams(gen_length=4, block_length=4), 9, 0, False,
                            torch.device("cpu"))

    shared = torch.tensor([True, True, False, False] + [False] * 4)
    own = fresh()
    own.admit()
    assert own.recompute.all() and not own.anchors.any() and own.phase is Phase.REFRESH
    with pytest.raises(RuntimeError, match="fixed once"):
        own.admit()
    given = fresh()
    given.admit(shared, torch.tensor([True] + [False] * 7))
    assert given.recompute.tolist() == [True, False] + [True] * 6 and given.anchors.tolist()[:2] == [True, False]
    chosen = fresh()
    chosen.admit(shared, select=True)
    assert chosen.selecting and chosen.recompute.all() and not chosen.anchors.any()
    chosen.fix_anchors(torch.tensor([False, True] + [False] * 6))
    assert not chosen.selecting and chosen.recompute.tolist() == [False, True] + [True] * 6
    for bad, message in [(dict(anchors=shared), "need the shared columns"), (dict(select=True), "need the shared"),
                         (dict(shared=shared), "either given or chosen"),
                         (dict(shared=shared, anchors=shared, select=True), "either given or chosen")]:
        with pytest.raises(ValueError, match=message):
            fresh().admit(**bad)


def test_exact_affixes_are_a_block_causal_models_affixes_at_column_0():
    """An affix's cached K/V (computed alone at positions 0..n-1) are exact where the request would compute the same:
    a block-causal model's affix at column 0 whose blocks hold only it, or whose last, partial block is recomputed
    for the request's own columns. Not after another token, not beside another affix in one block, never on a
    bidirectional model."""
    def state(prompt_len: int, gen_at: int, block: int | None) -> RequestState:
        return RequestState(Layout(tuple(range(1, prompt_len + 1)), gen_at),
                            SamplingParams(gen_length=4, block_length=4), 99, 0, False, torch.device("cpu"),
                            attention_block=block)

    assert state(12, 12, 4).exact_affixes([(0, 8)]) == [True]  # whole blocks
    assert state(12, 12, 4).exact_affixes([(0, 6)]) == [True]  # block [4, 8) holds own columns: recomputed
    assert state(12, 12, 4).exact_affixes([(1, 9)]) == [False]  # a token before it: computed alone it never saw it
    assert state(12, 12, 4).exact_affixes([(0, 6), (6, 10)]) == [False, False]  # [4, 8) mixes the two affixes
    assert state(12, 12, 4).exact_affixes([(0, 8), (8, 12)]) == [True, False]  # the second sees the first
    assert state(8, 0, 4).exact_affixes([(4, 12)]) == [False]  # after the masks (an infill's suffix)
    assert state(12, 12, None).exact_affixes([(0, 8)]) == [False]  # bidirectional: it sees what follows
    assert state(12, 12, 4).exact_affixes([]) == []
    # the rule, read on the host, is the recompute set's: the last block is recomputed, or the affix fills it
    for spans in ([(0, 5)], [(0, 7), (7, 9)], [(0, 3), (4, 11)], [(0, 9)], [(0, 12)], [(2, 6)]):
        s = state(12, 12, 4)
        shared = torch.zeros(s.length, dtype=torch.bool)
        for c0, c1 in spans:
            shared[c0:c1] = True
        base = s.base_recompute(shared)
        assert s.exact_affixes(spans) == [c0 == 0 and (c1 % 4 == 0 or bool(base[c1 - 1])) for c0, c1 in spans]
