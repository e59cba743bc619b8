"""Commit rules on hand-made confidence vectors."""

from __future__ import annotations

import pytest
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


def test_confidence_is_taken_over_the_whole_vocabulary():
    """Upstream scores p(x0) under the full softmax; removing [MASK] first would inflate it to
    p(x0) / (1 - p(mask)) and flip a 0.6 threshold here."""
    from acache.decoding.sampler import propose

    mask = 3
    probs = torch.tensor([0.57, 0.03, 0.0, 0.40])  # [MASK] (id 3) holds 40%
    logits = probs.clamp_min(1e-12).log()[None, None]
    x0, conf = propose(logits, 0.0, mask_token_id=mask)
    assert x0.item() == 0  # [MASK] is never proposed, even when it is the most likely
    assert conf.item() == pytest.approx(0.57, rel=1e-5)
    assert conf.item() < 0.6 < 0.57 / 0.6  # the filtered softmax would have said 0.95
    masked = torch.ones(1, 2, dtype=torch.bool)
    assert Threshold(0.6).select(torch.tensor([[conf.item(), 0.1]]), masked, 0).tolist() == [[True, False]]
    only_mask = torch.tensor([[[0.0, 0.0, 0.0, 9.0]]])
    x0, conf = propose(only_mask, 0.0, mask_token_id=mask)
    assert x0.item() != mask and conf.item() < 0.01


def test_a_tie_proposes_the_first_of_the_equal_tokens():
    """Greedy proposals break ties as argmax does, at the lowest id, in every row of a batch alike."""
    from acache.decoding.sampler import propose

    logits = torch.tensor([[[1.0, 5.0, 2.0, 5.0, 5.0], [7.0, 0.0, 7.0, 1.0, 1.0]],
                           [[0.0, 0.0, 0.0, 0.0, 0.0], [3.0, 3.0, 9.0, 9.0, 0.0]]])
    x0, _ = propose(logits, 0.0)
    assert x0.tolist() == [[1, 0], [0, 2]] == logits.argmax(-1).tolist()
    x0, _ = propose(logits, 0.0, mask_token_id=1)  # the masked id out: the next equal token
    assert x0.tolist() == [[3, 0], [0, 2]]


def test_forced_head_step_commits_exactly_the_head():
    """A shifted model's block: step 0 commits the first position alone, however confident the others."""
    from acache.decoding.commit import commit_step

    tokens = torch.full((2, 4), 9)
    x0 = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    conf = torch.tensor([[0.1, 0.99, 0.98, 0.97], [0.2, 0.3, 0.95, 0.1]])
    masked = torch.ones(2, 4, dtype=torch.bool)
    for rule in (Threshold(0.9), Factor(1.0), LowConfidence(2)):
        rule.begin_block(masked.sum(-1), head_forced=True)
        new, still = commit_step(rule, tokens, x0, conf, masked, step=0, force_head=True)
        assert new.tolist() == [[1, 9, 9, 9], [5, 9, 9, 9]]
        assert still.sum(-1).tolist() == [3, 3]
        unforced, _ = commit_step(rule, tokens, x0, conf, masked, step=0, force_head=False)
        assert unforced[0, 0].item() == 9  # without the rule the head (least confident) waits
    rule = LowConfidence(3)
    rule.begin_block(torch.tensor([8]), head_forced=True)
    assert rule.schedule.tolist() == [[1, 4, 3]]  # the other steps share the rest of the block


def test_dream_engine_commits_one_token_on_each_block_refresh(dream_dir):
    from acache.engine import EngineConfig, LLMEngine
    from acache.models.loader import load_model
    from acache.sampling_params import SamplingParams

    model = load_model(dream_dir)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22))
    params = SamplingParams(gen_length=16, block_length=8, threshold=0.01)  # every mask passes the threshold
    engine.add_request(list(range(10, 20)), params)
    engine.step()  # admission and block 0's refresh
    (req,) = engine.scheduler.running
    mask = model.config.mask_token_id
    block0 = req.state.tokens[10:18]
    assert (block0 != mask).tolist() == [True] + [False] * 7  # the head alone, though all pass the threshold
    engine.step()  # the first in-block step takes the rest
    assert not (req.state.tokens[10:18] == mask).any() and req.state.phase.value == "refresh"
    engine.step()
    assert (req.state.tokens[18:26] != mask).sum() == 1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_proposals_match_the_log_softmax_definition(temperature):
    """Tokens and confidences against the written-out definition (``[MASK]`` filled with -inf before the
    choice, ``p(x0)`` from the whole vocabulary's log-softmax), on a batch where ``[MASK]`` is the most likely
    token at some positions only, so the second look runs for those and leaves the others as they were."""
    from acache.decoding.sampler import propose

    gen = torch.Generator().manual_seed(3)
    mask, vocab = 5, 40
    logits = torch.randn(3, 6, vocab, generator=gen) * 4
    logits[0, 1, mask] = logits[2, 4, mask] = 50.0
    if temperature == 0:
        want_x0 = logits.index_fill(-1, torch.tensor([mask]), float("-inf")).argmax(-1)
        x0, conf = propose(logits, 0.0, mask_token_id=mask)
    else:
        draws = [torch.Generator().manual_seed(i) for i in range(3)]
        scores = logits.double().index_fill(-1, torch.tensor([mask]), float("-inf")) / temperature
        noise = torch.stack([torch.ones(6, vocab, dtype=torch.float64).exponential_(generator=g) for g in draws])
        want_x0 = (scores - noise.log()).argmax(-1)
        x0, conf = propose(logits, temperature, [torch.Generator().manual_seed(i) for i in range(3)],
                           mask_token_id=mask)
    assert torch.equal(x0, want_x0) and not bool((x0 == mask).any())
    want_conf = logits.log_softmax(-1).gather(-1, want_x0[..., None]).squeeze(-1).exp()
    torch.testing.assert_close(conf, want_conf, rtol=1e-6, atol=1e-7)
