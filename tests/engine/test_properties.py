"""Property: any mix of requests on the engine decodes each exactly as the reference path does alone.

Hypothesis draws batches of 1-12 requests that mix prompt lengths; no affix, prefix, infix, suffix and
two affixes; ``gen_length`` and ``block_length``; each commit rule; thresholds and factors; temperature
0 and > 0 with seeds; every cache policy; every selector (with and without ``probe_step``) and both
BiCache modes; ratios in [0, 1]; refresh intervals; and arrivals at different engine steps, on engines
of different page sizes, slots and token budgets, on LLaDA, Dream and the block-diffusion family (whose prefix
affixes are exact and take no anchors). Each request's tokens, anchors and NFE must equal the reference's.
``make test`` runs a derandomized profile; ``make test-long`` the long one.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acache.affix.bicache import BiCacheProfile
from acache.affix.prompt import AffixPrompt
from acache.affix.store import AffixStore
from acache.policies import ANCHOR_QUERIES, COMMIT_RULES, ONE_PASS_SELECTORS, QUERY_SELECTORS, SELECTORS
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.helpers import run_engine

settings.register_profile("ci", max_examples=150, derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("long", max_examples=3000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PROFILE = os.environ.get("ACACHE_HYPOTHESIS_PROFILE", "ci")

# a few shared affixes, so requests of one batch hit each other's pages
AFFIXES = [tuple(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()) for n in (5, 12, 23)]
LAYOUT_KINDS = ("none", "prefix", "infix", "suffix", "two")
SELECTOR_CHOICES = (*SELECTORS, "bicache-matched", "bicache-profiled")


@st.composite
def requests(draw):
    kind = draw(st.sampled_from(LAYOUT_KINDS))
    words = st.lists(st.integers(0, 255), min_size=1, max_size=9)
    q1, q2 = draw(words), draw(words)
    a1, a2 = draw(st.sampled_from(AFFIXES)), draw(st.sampled_from(AFFIXES))
    if kind == "none":
        prompt = AffixPrompt.from_spans(q1)
    elif kind == "prefix":
        prompt = AffixPrompt.from_spans(a1 + tuple(q1), None, [(0, len(a1))])
    elif kind == "infix":
        prompt = AffixPrompt.from_spans(tuple(q1) + a1 + tuple(q2), None, [(len(q1), len(q1) + len(a1))])
    elif kind == "suffix":
        prompt = AffixPrompt.from_spans(tuple(q1) + a1, len(q1), [(len(q1), len(q1) + len(a1))])
    else:
        ids = a1 + tuple(q1) + a2 + tuple(q2)
        prompt = AffixPrompt.from_spans(ids, None, [(0, len(a1)), (len(a1) + len(q1), len(a1) + len(q1) + len(a2))])
    block = draw(st.sampled_from([2, 4, 8]))
    gen = block * draw(st.integers(1, 3))
    remasking = draw(st.sampled_from(COMMIT_RULES))
    kw = dict(gen_length=gen, block_length=block, remasking=remasking)
    if remasking == "low_confidence":
        blocks = gen // block
        kw["steps"] = blocks * draw(st.sampled_from([d for d in range(1, block + 1) if block % d == 0]))
    kw["threshold"] = draw(st.floats(0.05, 1.0))
    kw["factor"] = draw(st.floats(0.1, 4.0))
    if draw(st.booleans()):
        kw["temperature"] = draw(st.floats(0.3, 2.0))
        kw["seed"] = draw(st.integers(0, 1000))
    kw["cache"] = draw(st.sampled_from(["none", "prefix", "dual", "dual"]))
    kw["refresh_interval"] = draw(st.sampled_from([None, None, 1, 2, 3]))
    if kw["cache"] == "dual" and draw(st.integers(0, 3)):
        kw["selector"] = draw(st.sampled_from(SELECTOR_CHOICES))
        kw["anchor_ratio"] = draw(st.floats(0.0, 1.0))
        kw["anchor_query"] = draw(st.sampled_from(ANCHOR_QUERIES))
        kw["probe_step"] = kw["selector"] not in ("bicache-matched", "bicache-profiled") and draw(st.booleans())
        if kw["selector"] not in ("bicache-matched", "bicache-profiled"):  # where the anchors are chosen
            one = kw["selector"] in ONE_PASS_SELECTORS and not kw["probe_step"] and (
                kw["anchor_query"] == "probe" or kw["selector"] not in QUERY_SELECTORS)
            kw["anchor_pass"] = draw(st.sampled_from([None, "one", "two"] if one else [None, "two"]))
            if one and kw["anchor_pass"] != "two":  # how deep the one pass scores
                kw["anchor_depth"] = draw(st.sampled_from([None, 1.0, 0.5, 0.1]))
    arrival = draw(st.integers(0, 6))
    return prompt, SamplingParams(**kw), arrival


@pytest.fixture(scope="module")
def profile(llada_dir):
    return BiCacheProfile(num_layers=2, tau=0.97, max_share=[0.3, 0.6, 1.0], safe_layers=[2, 1, 0], samples=[1, 1, 1])


@pytest.mark.parametrize("family", ["llada", "dream", "fast_dllm_v2"])
@settings(settings.get_profile(PROFILE))
@given(batch=st.lists(requests(), min_size=1, max_size=12), page_size=st.sampled_from([2, 4, 16]),
       max_num_seqs=st.integers(1, 12), token_budget=st.sampled_from([16384, 16384, 64, 8]))
def test_any_mix_of_requests_decodes_each_as_alone(family, llada_dir, dream_dir, blockdiff_dir, profile, batch,
                                                   page_size, max_num_seqs, token_budget):
    from acache.engine import EngineConfig, LLMEngine

    model = _model(family, {"llada": llada_dir, "dream": dream_dir, "fast_dllm_v2": blockdiff_dir})
    prompts = [p for p, _, _ in batch]
    params = [sp for _, sp, _ in batch]
    config = EngineConfig(page_size=page_size, kv_cache_memory=1 << 24, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=token_budget)
    engine = LLMEngine(model, config, bicache_profile=profile)
    outs = run_engine(model, prompts, params, arrivals=[a for _, _, a in batch], engine=engine)
    store = AffixStore(model)
    for i, (prompt, sp, out) in enumerate(zip(prompts, params, outs, strict=True)):
        ref = reference_generate(model, prompt, sp, store, bicache_profile=profile)
        assert out.error is None, f"request {i} failed: {out.error}"
        assert out.token_ids == ref.token_ids, f"request {i}: {sp}"
        assert out.anchors == ref.anchors, f"request {i}: {sp}"
        assert (out.nfe, out.refreshes) == (ref.nfe, ref.refreshes), f"request {i}: {sp}"
    assert engine.pool.num_used == engine.affixes.pages_in_use


_MODELS: dict[str, object] = {}


def _model(family, dirs):
    from acache.models.loader import load_model

    if family not in _MODELS:
        _MODELS[family] = load_model(dirs[family])
    return _MODELS[family]
