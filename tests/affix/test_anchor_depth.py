"""``anchor_depth``: a one-pass selection that stops scoring part-way down the layers. Its anchors are those a
model cut after its last scoring layer chooses at every layer, the layers after it run in one call, its edges
are still direct reuse and full recomputation, and mixed batches of depths arriving apart decode as each
request alone."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from acache.affix.selectors.base import filter_steps
from acache.affix.store import AffixStore
from acache.policies import ONE_PASS_SELECTORS
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from acache_lab.eval.cost import filtering_passes
from tests.affix.helpers import affix_run, assert_each_as_alone, layouts
from tests.conftest import _served, tiny_checkpoint

BASE = dict(gen_length=16, block_length=8, threshold=0.5)
LAYERS = 6


@pytest.fixture(scope="module", params=["llada", "dream", "fast_dllm_v2"])
def deep_model(request, tmp_path_factory):
    """A 6-layer model: deep enough that a depth below 1 leaves layers unscored (a 2-layer one has one step)."""
    extra = {"block_size": 4} if request.param == "fast_dllm_v2" else {}
    return _served(tiny_checkpoint(tmp_path_factory.mktemp(f"deep-{request.param}"), request.param, layers=LAYERS,
                                   **extra))


def cut(model, layers: int):
    """The model's first ``layers`` layers alone (the same weights)."""
    short = copy.deepcopy(model)
    short.layers = short.layers[:layers]
    short.config = dataclasses.replace(short.config, num_layers=layers)
    return short


@pytest.mark.parametrize("selector", ONE_PASS_SELECTORS)
@pytest.mark.parametrize("depth", [0.2, 0.5])
def test_anchors_are_those_of_the_model_cut_after_the_last_scoring_layer(deep_model, selector, depth):
    """At depth d the candidates are filtered after layers 1 .. s (s = ceil(d * (L - 1))) exactly as a model of s + 1
    layers filters them at every layer, so both choose the same anchors; the deeper layers change none (each layout
    at a ratio of its own)."""
    steps = filter_steps(LAYERS - 1, depth)
    short = cut(deep_model, steps + 1)
    store, short_store = AffixStore(deep_model), AffixStore(short)
    differ = 0
    for (name, prompt), ratio in zip(layouts(affix_len=24).items(), (0.2, 0.5, 0.3, 0.4), strict=True):
        params = SamplingParams(**BASE, selector=selector, anchor_ratio=ratio, anchor_depth=depth)
        got = reference_generate(deep_model, prompt, params, store)
        want = reference_generate(short, prompt, SamplingParams(**BASE, selector=selector, anchor_ratio=ratio),
                                  short_store)
        exact = name == "prefix" and deep_model.config.block_size is not None  # a block-causal prefix: no anchors
        assert got.anchors == want.anchors and (len(got.anchors) == 0) == exact
        every = reference_generate(deep_model, prompt, SamplingParams(**BASE, selector=selector, anchor_ratio=ratio),
                                   store)
        differ += every.anchors != got.anchors
    if selector != "cacheblend":  # the deviation of one layer can pick what the deeper ones pick
        assert differ > 0  # scoring every layer is not the same selection: the equality above has teeth


@pytest.mark.parametrize("depth, calls, scored", [(1.0, LAYERS - 1, LAYERS - 1), (0.7, 5, 4), (0.5, 4, 3),
                                                  (0.2, 2, 1)])
def test_the_layers_after_the_last_scoring_one_run_in_one_call(deep_model, depth, calls, scored, monkeypatch):
    """Layers 0-1 run together, then each scoring layer alone (the candidates are filtered between them), then
    the rest in one call that captures nothing for a score; each layer still runs once a forward (no forward
    besides the decoding ones), and the token-layers fed are the study's cost model's (bidirectional families)."""
    prompt = layouts()["infix"]
    store = AffixStore(deep_model)
    store.compute(prompt.affix_ids(prompt.affixes[0]))
    seen = []
    real = type(deep_model).run_layers

    def counting(self, hidden, positions, valid, past, layers, *args, **kw):
        seen.append((tuple(layers), hidden.shape[1], kw.get("capture_rotated", False)))
        return real(self, hidden, positions, valid, past, layers, *args, **kw)

    monkeypatch.setattr(type(deep_model), "run_layers", counting)
    params = SamplingParams(**BASE, selector="attention", anchor_ratio=0.3, anchor_depth=depth)
    reference_generate(deep_model, prompt, params, store)
    spans = [span for span, _, _ in seen]
    assert spans.count((0, 1)) == 1  # one selecting refresh; every other forward runs its layers in one call
    start = spans.index((0, 1))
    selecting = seen[start:start + calls]
    assert sorted(layer for span, _, _ in selecting for layer in span) == list(range(LAYERS))
    assert all(len(span) == 1 for span, _, _ in selecting[1:-1]) and len(selecting[-1][0]) == LAYERS - calls
    assert [capture for _, _, capture in selecting] == [True] * scored + [False] * (calls - scored)
    assert all(span == tuple(range(LAYERS)) for span in spans[:start] + spans[start + calls:])
    if deep_model.config.block_size is None:  # a block-causal model also recomputes the affix columns that share
        fed = sum(width * len(span) for span, width, _ in selecting)  # a block with its own: not in the cost model
        canvas, affix = len(prompt.token_ids) + BASE["gen_length"], [a.length for a in prompt.affixes]
        assert fed == filtering_passes("attention", canvas, affix, LAYERS, 0.3, depth)


@pytest.mark.parametrize("depth", [0.2, 0.5])
def test_edges_are_direct_reuse_and_full_recomputation(deep_model, depth):
    """Ratio 0 at any depth is direct reuse and ratio 1 full recomputation, token for token, in every layout."""
    store = AffixStore(deep_model)
    for prompt in layouts().values():
        direct = affix_run(deep_model, prompt, SamplingParams(**BASE, selector="none"), store)[0]
        full = affix_run(deep_model, prompt, SamplingParams(**BASE))[0]
        zero, one = (affix_run(deep_model, prompt, SamplingParams(**BASE, selector="attention", anchor_ratio=r,
                                                                  anchor_depth=depth), store)[0] for r in (0.0, 1.0))
        assert zero.token_ids == direct.token_ids and zero.anchors == []
        assert one.token_ids == full.token_ids


def test_mixed_depths_arriving_apart_decode_as_each_alone(deep_model):
    """Depths, selectors, ratios (0 and 1 among them) and lengths mixed in one batch, arriving at different steps:
    each request's tokens and anchors are the reference path's for it alone."""
    extra = layouts(affix_len=10, question_len=5, seed=5)
    prompts = [*layouts().values(), *layouts(affix_len=14, question_len=9, seed=3).values(), extra["prefix"],
               extra["two-affix"]]
    params = [SamplingParams(**{**BASE, "gen_length": g}, selector=s, anchor_ratio=r, anchor_depth=d)
              for s, r, g, d in (("attention", 0.3, 16, 0.2), ("attention", 0.3, 8, None),
                                 ("cacheblend", 0.2, 16, 0.5), ("query-attention", 0.5, 24, 0.7),
                                 ("attention-deviation", 0.25, 16, 0.3), ("kv-deviation", 0.3, 8, None),
                                 ("attention", 0.1, 24, 1.0), ("cacheblend", 0.6, 16, 0.2),
                                 ("attention", 0.0, 16, 0.2), ("query-attention", 1.0, 8, 0.5))]
    assert_each_as_alone(deep_model, prompts, params, AffixStore(deep_model), [2, 0, 1, 4, 0, 3, 1, 5, 2, 0])


def test_a_selecting_forward_scores_to_one_depth(deep_model, monkeypatch):
    """Requests that choose their anchors at the same time share a selecting forward only with those of their depth,
    so a shallow one never scores as deep as its neighbour; a request with two affixes shares it with one of one
    (each forward runs once: none is rerun apart after a failure)."""
    from acache.engine import model_runner

    batches = []
    real = model_runner.refresh_selecting

    def refresh(model, *args):
        batches.append(sorted(args[-2]))  # SelectingInputs.depths
        return real(model, *args)

    monkeypatch.setattr(model_runner, "refresh_selecting", refresh)
    prompts = list(layouts().values())
    params = [SamplingParams(**BASE, selector="attention", anchor_ratio=0.3, anchor_depth=d) for d in (0.2, 1.0, 0.2,
                                                                                                      None)]
    affix_run(deep_model, prompts, params, AffixStore(deep_model))
    # a block-causal model's prefix affix is exact: that request (depth 0.2) takes no anchors and chooses none
    assert sorted(batches) == ([[0.2], [1.0, 1.0]] if deep_model.config.block_size else [[0.2, 0.2], [1.0, 1.0]])
