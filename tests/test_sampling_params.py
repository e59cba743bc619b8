"""SamplingParams are validated once, at construction, with messages that name the problem."""

from __future__ import annotations

import pytest

from acache import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(gen_length=100, block_length=32), r"gen_length \(100\) must be a multiple of block_length \(32\)"),
    (dict(gen_length=128, block_length=32, steps=2), r"steps \(2\) must be at least the number of blocks \(4"),
    (dict(gen_length=128, block_length=32, steps=6), r"steps \(6\) must be a multiple of the number of blocks"),
    (dict(threshold=0.0), r"threshold must be in \(0, 1\]"),
    (dict(threshold=1.5), r"threshold must be in \(0, 1\]"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(gen_length=0), "gen_length must be a positive integer"),
    (dict(block_length=-8), "block_length must be a positive integer"),
    (dict(cache="triple"), "cache must be one of none, prefix, dual"),
    (dict(remasking="random"), "remasking must be one of"),
    (dict(factor=0), "factor must be positive"),
    (dict(refresh_interval=0), "refresh_interval must be a positive integer"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(probe_step=True), "probe_step decodes the first step .* needs an anchor affix_policy"),
    (dict(probe_step=True, affix_policy="bicache-matched"), "probe_step .* got 'bicache-matched'"),
    (dict(probe_step=1, affix_policy="attention"), "probe_step must be true or false"),
    (dict(anchor_query="deep"), "anchor_query must be one of probe, full, shallow, got 'deep'"),
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
