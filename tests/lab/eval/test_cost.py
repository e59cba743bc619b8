"""The cost model of the study: each selector's passes from its definition, on the mean qa1 request."""

from __future__ import annotations

import pytest

from acache.affix.prompt import AffixPrompt
from acache.models.loader import load_model
from acache.sampling_params import SamplingParams
from acache_lab.eval.cost import (
    counts,
    exact_affixes,
    fresh_affix_columns,
    refresh_passes,
    request_passes,
    selection_passes,
)
from tests.helpers import run_engine

# a 48-column canvas: an affix of 38 tokens, 8 other prompt tokens, 2 masks; 4 layers; k = ceil(0.2 * 38) = 8
CANVAS, AFFIX, LAYERS, RATIO = 48, [38], 4, 0.2


@pytest.mark.parametrize("policy, query, passes", [
    ("attention", "probe", 10 * 4),
    ("query-attention", "probe", 10 * 4),
    ("attention", "full", 48 * 4),
    ("attention", "shallow", 10 * 1),  # the probe's first layer of 4
    ("query-attention", "shallow", 10 * 4),  # reads no anchor query
    ("kv-deviation", "probe", 48 * 4),
    ("attention-deviation", "probe", 10 * 4 + (10 + 16) * 2),  # its 2k = 16 candidates
    ("attention-deviation", "full", 48 * 4),
    ("attention-deviation", "shallow", 10 * 1 + (10 + 16) * 2),
    ("cacheblend", "probe", 48 * 2 + (10 + 16) + (10 + 12)),  # carries 16, then 12, keeps 8
    ("influence", "probe", 10 * 4 + 38 * 4),  # the probe, and the affix alone for its queries
    ("first-k", "probe", 0), ("random", "probe", 0), ("none", "probe", 0), ("all", "probe", 0),
])
def test_selection_passes(policy, query, passes):
    assert selection_passes(policy, query, CANVAS, AFFIX, LAYERS, RATIO) == passes


def test_refresh_and_request_passes():
    assert refresh_passes("attention", CANVAS, AFFIX, LAYERS, RATIO) == (10 + 8) * 4
    assert refresh_passes("none", CANVAS, AFFIX, LAYERS, RATIO) == 10 * 4
    assert refresh_passes("all", CANVAS, AFFIX, LAYERS, RATIO) == refresh_passes(None, CANVAS, AFFIX, LAYERS, 0.0)
    assert request_passes(None, "probe", CANVAS, AFFIX, LAYERS, 0.0) == 48 * 4
    assert request_passes("cacheblend", "probe", CANVAS, [20, 18], LAYERS, 0.5) == (
        48 * 2 + (10 + 20 + 18) + (10 + 15 + 14) + (10 + 10 + 9) * 4)


def test_one_pass_request_passes_by_depth():
    """One pass: layers 0-1 of the canvas, then the 10 own columns and the carried candidates of the 38-token affix
    (k = 8) through layers 2 and 3; at a lower depth they reach k sooner (16, 12 -> 16, 8 -> 8, 8)."""
    def one(depth):
        return request_passes("attention", "probe", CANVAS, AFFIX, LAYERS, RATIO, "one", depth)

    assert one(1.0) == 48 * 2 + (10 + 16) + (10 + 12)
    assert one(0.5) == 48 * 2 + (10 + 16) + (10 + 8)
    assert one(0.25) == 48 * 2 + (10 + 8) * 2


def test_an_exact_affix_costs_what_direct_reuse_costs():
    """An affix exact where it is placed takes no anchors short of the whole affix, so a request whose affixes all are
    selects nothing and refreshes its own columns alone, in either pass; beside an approximate affix only that one's
    anchors and candidates count. Ratio 0 selects nothing either (the engine skips it)."""
    direct = request_passes("none", "probe", CANVAS, AFFIX, LAYERS, 0.0)
    for policy, anchor_pass in (("attention", "one"), ("attention", "two"), ("kv-deviation", "two"),
                                ("cacheblend", "one"), ("attention-deviation", "two")):
        assert request_passes(policy, "probe", CANVAS, AFFIX, LAYERS, RATIO, anchor_pass, exact=[True]) == direct == 40
        assert request_passes(policy, "probe", CANVAS, AFFIX, LAYERS, 0.0, anchor_pass) == direct
    assert request_passes("attention", "probe", CANVAS, AFFIX, LAYERS, 1.0, "one", exact=[True]) == 48 * 4
    assert request_passes("attention", "probe", CANVAS, [20, 18], LAYERS, 0.5, "one", exact=[True, False]) == (
        (10 + 18) * 2 + (10 + 18) + (10 + 14))  # the first stays cached; the second carries 18, then 14, keeps 9
    # a pass of its own (two-pass cacheblend) scores both affixes; only the approximate one's anchors are refreshed
    assert request_passes("cacheblend", "probe", CANVAS, [20, 18], LAYERS, 0.5, exact=[True, False]) == (
        48 * 2 + (10 + 20 + 18) + (10 + 15 + 14) + (10 + 9) * 4)
    assert selection_passes("attention", "probe", CANVAS, AFFIX, LAYERS, RATIO, [True]) == 0
    assert refresh_passes("attention", CANVAS, AFFIX, LAYERS, RATIO, [True]) == 10 * 4


def test_columns_recomputed_anyway_cost_as_own_and_are_never_anchors():
    """A block-causal model's affix shares its first and last attention blocks with the request's own columns (blocks
    of 8: an affix at columns 3-40 has 3-7 and 40 so), a shifted model recomputes the column before the region: those
    columns are counted as own ones, anchors come from the rest (capped there), and the cost model's refresh feeds
    what the engine's does, request for request."""
    model = load_model("models/acache-tiny-blockdiff")
    cfg = model.config
    ids = list(range(1, 60))
    infix = AffixPrompt.from_spans(ids[:48], None, [(3, 41)])
    before_region = AffixPrompt.from_spans(ids[:41], None, [(3, 41)])
    assert cfg.block_size == 8 and fresh_affix_columns(cfg, infix, 2, shifted=True) == [5 + 1]
    assert fresh_affix_columns(cfg, before_region, 2, shifted=True) == [5 + 1]  # 40: a block with the region
    assert fresh_affix_columns(load_model("models/acache-tiny").config, before_region, 2, shifted=True) == [1]
    assert fresh_affix_columns(load_model("models/acache-tiny").config, infix, 2, shifted=False) == [0]
    assert counts("attention", [38], 0.2, None, [6]) == [8] and counts("all", [38], 0.0, None, [6]) == [32]
    assert refresh_passes("attention", 50, [38], 4, 0.2, None, [6]) == (12 + 6 + 8) * 4
    # one pass: layers 0-1 on all 50, then the 18 own columns and the carried candidates (16, then 12 -> k = 8)
    assert request_passes("attention", "probe", 50, [38], 4, 0.2, "one", 1.0, None, [6]) == 50 * 2 + 18 + 16 + 18 + 12
    # attention-deviation's pass: the probe (18 own), then layers 0-1 of the 12 non-affix columns and 16 candidates
    assert selection_passes("attention-deviation", "probe", 50, [38], 4, 0.2, None, [6]) == 18 * 4 + (12 + 16) * 2
    prompts = [infix, before_region, AffixPrompt.from_spans(ids[:20], None, [(0, 12)])]
    params = [SamplingParams(gen_length=2, block_length=2, selector=s, anchor_ratio=r)
              for s, r in (("attention", 0.2), ("random", 0.5), ("attention", 0.3))]
    outs = run_engine(model, prompts, params, arrivals=[0, 1, 0])
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        canvas, affixes = len(prompt.token_ids) + 2, [a.length for a in prompt.affixes]
        fresh = fresh_affix_columns(cfg, prompt, 2, shifted=model.shifted_logits)
        assert out.recomputed_per_refresh * cfg.num_layers == refresh_passes(
            sp.selector, canvas, affixes, cfg.num_layers, sp.anchor_ratio, exact_affixes(cfg, prompt, 2), fresh)
        assert out.cached_tokens == sum(affixes) - sum(fresh) - len(out.anchors)


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="no cost model for policy 'bicache-matched'"):
        selection_passes("bicache-matched", "probe", CANVAS, AFFIX, LAYERS, RATIO)
