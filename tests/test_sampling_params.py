"""SamplingParams are validated once, at construction, with messages that name the problem."""

from __future__ import annotations

import pytest

from acache import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(gen_length=100, block_length=32), r"gen_length \(100\) must be a multiple of block_length \(32\)"),
    (dict(gen_length=128, block_length=32, steps=2), r"steps \(2\) must be at least the number of blocks \(4"),
    (dict(gen_length=128, block_length=32, steps=6), r"steps \(6\) must be a multiple of the number of blocks"),
    (dict(threshold=0.0), r"threshold must be in \(0, 1\]"),
    (dict(focus_ratio=0.5), r"focus_ratio \(0.5\) applies with focus_layers, which is unset"),
    (dict(focus_layers=1, refresh_interval=1), "refresh_interval=1 makes every step a refresh"),
    (dict(threshold=1.5), r"threshold must be in \(0, 1\]"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(gen_length=0), "gen_length must be a positive integer"),
    (dict(block_length=-8), "block_length must be a positive integer"),
    (dict(cache="triple"), "cache must be one of none, prefix, dual"),
    (dict(remasking="random"), "remasking must be one of"),
    (dict(factor=0), "factor must be positive"),
    (dict(refresh_interval=0), "refresh_interval must be a positive integer"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(probe_step=True), "probe_step decodes the first step .* needs an anchor selector"),
    (dict(probe_step=True, selector="bicache-matched"), "probe_step .* got 'bicache-matched'"),
    (dict(probe_step=1, selector="attention"), "probe_step must be true or false"),
    (dict(anchor_query="deep"), "anchor_query must be one of probe, full, shallow, got 'deep'"),
    (dict(selector="attention", anchor_pass="three"), "anchor_pass must be one of one, two or None, got 'three'"),
    (dict(anchor_pass="one"), "anchor_pass .* needs an anchor selector .* got None"),
    (dict(selector="bicache-matched", anchor_pass="two"), "anchor_pass .* got 'bicache-matched'"),
    (dict(selector="kv-deviation", anchor_pass="one"), "'kv-deviation' has no one-pass form"),
    (dict(selector="influence", anchor_pass="one"), "'influence' has no one-pass form"),
    (dict(selector="attention", anchor_pass="one", probe_step=True), "probe_step need.* anchor_pass='two'"),
    (dict(selector="attention", anchor_pass="one", anchor_query="full"),
     "anchor_query='full' need.* anchor_pass='two'"),
    (dict(selector="attention", anchor_depth=0), r"anchor_depth must be a number in \(0, 1\], got 0"),
    (dict(selector="attention", anchor_depth=-0.5), r"anchor_depth must be a number in \(0, 1\], got -0.5"),
    (dict(selector="attention", anchor_depth=1.5), r"anchor_depth must be a number in \(0, 1\], got 1.5"),
    (dict(selector="attention", anchor_depth=float("nan")), r"anchor_depth must be a number in \(0, 1\], got nan"),
    (dict(selector="attention", anchor_depth=True), r"anchor_depth must be a number .* got True"),
    (dict(selector="attention", anchor_depth="0.5"), r"anchor_depth must be a number .* got '0.5'"),
    (dict(anchor_depth=0.5), "anchor_depth 0.5 .* needs an anchor selector .* got None"),
    (dict(selector="bicache-matched", anchor_depth=0.5), "anchor_depth 0.5 .* got 'bicache-matched'"),
    (dict(selector="kv-deviation", anchor_depth=0.5), "anchor_depth 0.5 .* needs anchor_pass 'one'.*'kv-deviation' "
     "resolves to 'two'"),
    (dict(selector="attention", anchor_pass="two", anchor_depth=0.5), "anchor_depth 0.5 .* needs anchor_pass 'one'"),
    (dict(selector="attention", probe_step=True, anchor_depth=0.25), "anchor_depth 0.25 .* resolves to 'two'"),
])
def test_invalid_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_and_schedule():
    p = SamplingParams()
    assert (p.gen_length, p.block_length, p.remasking, p.threshold, p.cache) == (128, 32, "threshold", 0.9, "dual")
    assert p.num_blocks == 4 and p.steps_per_block == 32
    assert SamplingParams(gen_length=256, block_length=32, steps=64).steps_per_block == 8
    assert SamplingParams(threshold=1.0).threshold == 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed="7"), "seed must be an integer"),
    (dict(seed=2**70), "seed must be an integer"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list"),
    (dict(threshold="0.9"), "threshold must be a number"),
    (dict(refresh_interval=True), "refresh_interval must be a positive integer"),
    (dict(anchor_ratio=None), "anchor_ratio must be a number"),
])
def test_wrong_types_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, resolved", [
    (dict(), None),
    (dict(selector="bicache-profiled"), None),
    (dict(selector="attention"), "one"),
    (dict(selector="cacheblend"), "one"),
    (dict(selector="cacheblend", anchor_query="full"), "one"),  # cacheblend reads no anchor_query
    (dict(selector="attention", anchor_query="shallow"), "two"),
    (dict(selector="query-attention", probe_step=True), "two"),
    (dict(selector="kv-deviation"), "two"),
    (dict(selector="random"), "two"),
    (dict(selector="attention-deviation", anchor_pass="two"), "two"),
])
def test_anchor_pass_resolves_once(kwargs, resolved):
    """Where anchors are chosen is resolved at construction: inside the refresh where the selector has that
    form and nothing asks for the separate pass."""
    assert SamplingParams(**kwargs).resolved_anchor_pass == resolved


@pytest.mark.parametrize("kwargs, resolved", [
    (dict(), 1.0),
    (dict(selector="attention"), 1.0),
    (dict(selector="kv-deviation"), 1.0),
    (dict(selector="attention", anchor_pass="two", anchor_depth=1), 1.0),
    (dict(selector="attention", anchor_depth=0.25), 0.25),
    (dict(selector="cacheblend", anchor_depth=0.5), 0.5),
])
def test_anchor_depth_resolves_once(kwargs, resolved):
    """How deep a one-pass selection scores is resolved at construction to a float: 1.0 (every
    layer) unless named."""
    depth = SamplingParams(**kwargs).resolved_anchor_depth
    assert depth == resolved and isinstance(depth, float)


@pytest.mark.parametrize("policy, has_affixes, want", [
    (None, True, (False, False)), ("attention", False, (False, False)), ("attention", True, (True, False)),
    ("none", True, (True, False)), ("bicache-matched", True, (True, True)), ("bicache-profiled", False, (False, False)),
])
def test_affix_reuse_needs_a_policy_and_an_affix(policy, has_affixes, want):
    assert SamplingParams(selector=policy).affix_reuse(has_affixes) == want


def test_replace_resolves_afresh_from_what_was_asked():
    from dataclasses import replace

    one = SamplingParams(selector="attention")
    assert one.anchor_pass is None and one.resolved_anchor_pass == "one" and one.resolved_anchor_depth == 1.0
    assert replace(one, probe_step=True).resolved_anchor_pass == "two"
    assert replace(one, selector=None).resolved_anchor_pass is None
    assert replace(one, selector="kv-deviation").resolved_anchor_pass == "two"
    assert replace(SamplingParams(selector="kv-deviation"), selector="attention").resolved_anchor_pass == "one"
    with pytest.raises(ValueError, match="has no one-pass form"):
        replace(one, anchor_pass="one", selector="kv-deviation")  # asked for, so still refused


def test_stop_token_ids_from_an_iterator_are_kept():
    assert SamplingParams(stop_token_ids=(t for t in [5, 7])).stop_token_ids == (5, 7)
    assert SamplingParams(stop_token_ids=iter([3])).stop_token_ids == (3,)
    with pytest.raises(ValueError, match="non-negative integers"):
        SamplingParams(stop_token_ids=(t for t in [5, -1]))


def test_anchor_counts_are_the_ceiling_of_ratio_times_length_at_any_ratio():
    from acache.affix.selectors.base import anchor_count

    assert [anchor_count(r, n) for r, n in ((0.3, 10), (0.2, 50), (1e-12, 100), (0.5 + 1e-12, 2), (0.0, 9))] == \
        [3, 10, 1, 2, 0]


def test_a_tiny_temperature_samples_near_the_argmax_without_overflow():
    import torch

    from acache.decoding.sampler import propose

    logits = -torch.rand(3, 5, 40) * 50 - 1000  # every logit far below zero
    x0, _ = propose(logits, 1e-310, [torch.Generator().manual_seed(i) for i in range(3)])
    assert torch.equal(x0, logits.argmax(-1))
