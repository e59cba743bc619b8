"""Commit rules on hand-made confidence vectors."""

from __future__ import annotations

import torch

from acache.decoding.commit import Factor, LowConfidence, Threshold, commit_top_k

NEG = float("-inf")


def test_low_confidence_quota_schedule():
    sched = LowConfidence.quota_schedule(torch.tensor([32, 10, 7]), 4)
    assert sched.tolist() == [[8, 8, 8, 8], [3, 3, 2, 2], [2, 2, 2, 1]]
    assert sched.sum(-1).tolist() == [32, 10, 7]


def test_low_confidence_commits_quota_of_most_confident():
    rule = LowConfidence(steps_per_block=2)
    masked = torch.tensor([[True, True, False, True, True]])
    rule.begin_block(masked.sum(-1))
    conf = torch.tensor([[0.1, 0.7, NEG, 0.3, 0.5]])
    assert rule.select(conf, masked, 0).tolist() == [[False, True, False, False, True]]


def test_threshold_commits_all_above_and_at_least_one():
    rule = Threshold(0.9)
    masked = torch.tensor([[True, True, True, True], [True, True, False, False], [False, False, False, False]])
    conf = torch.tensor([[0.95, 0.2, 0.91, 0.9], [0.3, 0.5, NEG, NEG], [NEG, NEG, NEG, NEG]])
    got = rule.select(conf, masked, 0)
    assert got.tolist() == [[True, False, True, True], [False, True, False, False], [False, False, False, False]]


def test_threshold_decoding_always_terminates():
    """Whatever the confidences, each step commits >= 1 masked position, so a block ends in <= L steps."""
    gen = torch.Generator().manual_seed(0)
    rule = Threshold(0.99)
    for _ in range(20):
        masked = torch.ones(3, 16, dtype=torch.bool)
        steps = 0
        while masked.any():
            conf = torch.where(masked, torch.rand(3, 16, generator=gen) * 0.5, NEG)
            commit = rule.select(conf, masked, steps)
            assert (commit.sum(-1) >= masked.any(-1).long()).all()
            assert not (commit & ~masked).any()
            masked &= ~commit
            steps += 1
        assert steps <= 16


def test_factor_rule_definition():
    """Largest n with c_n >= 1 - f/(n+1): with f=1 the bounds are 0.5, 0.667, 0.75, 0.8, ..."""
    rule = Factor(1.0)
    conf = torch.tensor([[0.9, 0.8, 0.7, 0.6, NEG],  # c1=.9>=.5, c2=.8>=.667, c3=.7<.75 -> n=2
                         [0.99, 0.98, 0.97, 0.85, 0.81],  # c4=.85>=.8, c5=.81<.833 -> n=4
                         [0.3, 0.2, 0.1, NEG, NEG]])  # none qualifies -> at least one
    masked = conf > NEG
    assert rule.count(conf, masked).tolist() == [2, 4, 1]
    got = rule.select(conf, masked, 0)
    assert got.sum(-1).tolist() == [2, 4, 1]
    assert got[1].tolist() == [True, True, True, True, False]
    # unsorted input: the rule sorts before counting and commits the most confident
    shuffled = torch.tensor([[0.6, 0.9, NEG, 0.7, 0.8]])
    assert rule.select(shuffled, shuffled > NEG, 0).tolist() == [[False, True, False, False, True]]
    assert Factor(2.0).count(conf[:1], masked[:1]).tolist() == [4]  # 2/(n+1): .333,.5,.6,.4 -> c4=.6>=.6


def test_commit_top_k_per_row_quotas():
    conf = torch.tensor([[0.1, 0.4, 0.3], [0.9, 0.8, NEG]])
    masked = conf > NEG
    assert commit_top_k(conf, masked, torch.tensor([2, 5])).tolist() == [[False, True, True], [True, True, False]]
