"""The Monte Carlo log-likelihood bound: exact where it has no randomness, unbiased where it has, seeded,
and the telescoped per-token values add up to each split's estimate."""

from __future__ import annotations

import itertools
import math
import threading

import pytest
import torch

from acache.scoring import (
    ScoreJob,
    ScoringCancelled,
    _chained_draws,
    _plan,
    bound_draws,
    continuation_logprob,
    score_jobs,
    split_estimates,
    token_logprobs,
)
from tests.conftest import random_prompts


def logp_masked(model, ids, masked, col):
    """log p(ids[col]) from one dense forward with the columns in ``masked`` replaced by the mask token."""
    fed = torch.tensor([[model.config.mask_token_id if i in masked else t for i, t in enumerate(ids)]])
    with torch.inference_mode():
        hidden = model(fed, torch.arange(len(ids))[None]).hidden
        return float(torch.log_softmax(model.logits(hidden), dim=-1)[0, col, ids[col]])


def exact_bound(model, ids, start):
    """The bound's expectation by enumerating every ``l`` and every set of ``l`` masked continuation tokens."""
    cols = range(start, len(ids))
    total = 0.0
    for size in range(1, len(cols) + 1):
        subsets = list(itertools.combinations(cols, size))
        mean = sum(sum(logp_masked(model, ids, set(s), c) for c in s) for s in subsets) / len(subsets)
        total += len(cols) / size * mean / len(cols)
    return total


def unmasked(model, length: int, seed: int = 0) -> list[int]:
    """Random token ids, the mask token replaced (a sequence holding it cannot be scored)."""
    mask = model.config.mask_token_id
    return [t + 1 if t == mask else t for t in random_prompts([length], vocab=model.config.vocab_size - 2,
                                                              seed=seed)[0]]


def test_one_token_continuation_is_exact_whatever_the_draws(family_model):
    ids = unmasked(family_model, 9)
    want = logp_masked(family_model, ids, {8}, 8)
    for seed, samples in [(0, 1), (1, 5), (7, 3)]:
        got = continuation_logprob(family_model, ids[:8], ids[8:], samples, torch.Generator().manual_seed(seed))
        assert got == pytest.approx(want, abs=1e-5)


def test_the_estimate_converges_to_the_bound(family_model):
    ids = unmasked(family_model, 8, seed=3)
    want = exact_bound(family_model, ids, 5)
    # 20,000 draws of three tokens are seven distinct masked sets, each forwarded once
    draws, _ = bound_draws(family_model, ids, [5], 20_000, torch.Generator().manual_seed(0), batch_size=512)
    stderr = float(draws.std()) / math.sqrt(len(draws))
    assert stderr > 0  # three tokens: the draws matter
    assert float(draws.mean()) == pytest.approx(want, abs=4 * stderr)


def test_a_seed_fixes_the_estimate_and_another_changes_it(family_model):
    ids = unmasked(family_model, 10, seed=4)
    one = continuation_logprob(family_model, ids[:4], ids[4:], 6, torch.Generator().manual_seed(11))
    again = continuation_logprob(family_model, ids[:4], ids[4:], 6, torch.Generator().manual_seed(11))
    other = continuation_logprob(family_model, ids[:4], ids[4:], 6, torch.Generator().manual_seed(12))
    assert one == again != other


def test_telescoped_values_add_up_to_each_split(family_model):
    ids = unmasked(family_model, 12, seed=5)
    scored = token_logprobs(family_model, ids, 2, 5, torch.Generator().manual_seed(9), top_k=3, batch_size=7)
    again = split_estimates(family_model, ids, range(2, 12), 5, torch.Generator().manual_seed(9))
    assert len(scored.values) == len(scored.top) == 10
    # the same forwards in batches of another size: float-close, not bit-equal (a CPU's matmul kernels block a
    # batch by its size: on an AMD EPYC the sums differ in the 8th digit even under one key mask)
    for c in range(2, 12):
        assert sum(scored.values[c - 2:]) == pytest.approx(again[c - 2], abs=1e-5)
        # a split's draws depend on the seed and the splits after it only: scored alone it gets the same ones
        alone = split_estimates(family_model, ids, [c], 5, torch.Generator().manual_seed(9))[0]
        assert sum(scored.values[c - 2:]) == pytest.approx(alone, abs=1e-5)
    # the top tokens at a position: its prediction with it and all after it masked, token by token (the token
    # itself is rarely among them on a random model, so reading its value alone checked nothing)
    fed = torch.tensor([[family_model.config.mask_token_id if i >= 7 else t for i, t in enumerate(ids)]])
    with torch.inference_mode():
        dist = torch.log_softmax(family_model.logits(family_model(fed, torch.arange(12)[None]).hidden), -1)[0, 7]
    values, tokens = dist.topk(3)
    assert list(scored.top[5]) == tokens.tolist()
    assert list(scored.top[5].values()) == pytest.approx(values.tolist(), abs=1e-5)


def test_batch_size_does_not_change_the_estimate(family_model):
    ids = unmasked(family_model, 10, seed=6)
    a = split_estimates(family_model, ids, [3, 6], 7, torch.Generator().manual_seed(2), batch_size=1)
    b = split_estimates(family_model, ids, [3, 6], 7, torch.Generator().manual_seed(2), batch_size=100)
    assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("start, samples, ids, message", [
    (0, 4, [1, 2, 3], "must start inside"),
    (3, 4, [1, 2, 3], "must start inside"),
    (1, 0, [1, 2, 3], "samples must be a positive integer"),
    (1, True, [1, 2, 3], "samples must be a positive integer"),
    (1, 4, [1, 10**6, 3], "outside the vocabulary"),
    (1, 4, [1, -1, 3], "outside the vocabulary"),
    (1, 4, [1] * 600, "more than the model's context"),
])
def test_bad_input_is_named(family_model, start, samples, ids, message):
    with pytest.raises(ValueError, match=message):
        split_estimates(family_model, ids, [start], samples, torch.Generator())


def test_bad_top_k_and_empty_continuation(family_model):
    with pytest.raises(ValueError, match="top_k"):
        token_logprobs(family_model, [1, 2, 3], 1, 2, torch.Generator(), top_k=-1)
    with pytest.raises(ValueError, match="continuation is empty"):
        continuation_logprob(family_model, [1, 2], [], 2, torch.Generator())
    # each used to pass the checks and fail inside the plan (min() of an empty sequence), or blame a split of 0
    with pytest.raises(ValueError, match="nothing to score: no split of the 3 tokens"):
        token_logprobs(family_model, [1, 2, 3], 3, 2, torch.Generator())
    with pytest.raises(ValueError, match="nothing to score"):
        split_estimates(family_model, [1, 2, 3], [], 2, torch.Generator())
    with pytest.raises(ValueError, match="the context is empty"):
        continuation_logprob(family_model, [], [1, 2], 2, torch.Generator())
    # splits given as an array are splits (the emptiness check read an array's truth value)
    import numpy as np

    as_array = split_estimates(family_model, [1, 2, 3, 4, 5], np.arange(2, 5), 2, torch.Generator().manual_seed(3))
    assert as_array == split_estimates(family_model, [1, 2, 3, 4, 5], [2, 3, 4], 2, torch.Generator().manual_seed(3))


def test_a_set_cancel_event_stops_scoring(family_model):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ScoringCancelled):
        split_estimates(family_model, [1, 2, 3, 4], [1, 2], 3, torch.Generator(), cancel=cancel)
    with pytest.raises(ScoringCancelled):
        token_logprobs(family_model, [1, 2, 3, 4], 1, 3, torch.Generator(), top_k=2, cancel=cancel)


class CancellingLock:
    """An engine lock stand-in that counts the forwards it is held around and sets ``cancel`` in the
    ``after``-th, as a client going away mid-request does."""

    def __init__(self, cancel: threading.Event, after: int) -> None:
        self.cancel, self.after, self.forwards = cancel, after, 0

    def __enter__(self):
        self.forwards += 1
        if self.forwards == self.after:
            self.cancel.set()

    def __exit__(self, *exc):
        return False


def test_a_cancel_during_scoring_stops_at_the_next_batch(family_model):
    ids = unmasked(family_model, 14, seed=8)
    cancel = threading.Event()
    lock = CancellingLock(cancel, after=2)
    with pytest.raises(ScoringCancelled):
        token_logprobs(family_model, ids, 1, 8, torch.Generator(), top_k=1, batch_size=2, lock=lock, cancel=cancel)
    assert lock.forwards == 2


def test_each_split_draws_exactly_the_bounds_distribution():
    """Chained draws: at every split, ``l`` uniform in ``1..L`` and the masked set uniform given ``l``, so each
    masked set ``M`` of the split's columns comes up with probability ``1 / (L * C(L, |M|))``."""
    n, first, chains = 7, 1, 40_000
    draws = _chained_draws(n, first, chains, torch.Generator().manual_seed(0))
    keys = (draws.masks.long() << torch.arange(n)).sum(1)
    for c in range(first, n):
        rows = draws.row[c - first]
        masks = draws.masks[rows]
        assert not masks[:, :c].any() and (masks.sum(1) == draws.size[c - first]).all()
        seen = torch.bincount(keys[rows], minlength=1 << n).double() / chains
        length = n - c
        worst = 0.0
        for size in range(1, length + 1):
            want = 1 / (length * math.comb(length, size))
            for subset in itertools.combinations(range(c, n), size):
                got = float(seen[sum(1 << i for i in subset)])
                worst = max(worst, abs(got - want) / math.sqrt(want * (1 - want) / chains + 1e-300))
        assert worst < 4.5, (c, worst)


def test_each_draw_is_its_masked_tokens_log_probability(family_model):
    """The same draws give the same values as one dense forward a draw: distinct masked sets forwarded once,
    sorted and batched, each (split, sample) reading its own."""
    if family_model.block_causal:  # scored block by block: tests below check that path against its own bound
        pytest.skip("a block-causal model's draws are its blocks' (test_a_block_causal_model_is_scored_...)")
    ids = unmasked(family_model, 9, seed=7)
    starts, samples = [2, 5, 8], 4
    draws, owner = bound_draws(family_model, ids, starts, samples, torch.Generator().manual_seed(3), batch_size=3)
    chain = _chained_draws(len(ids), min(starts), samples, torch.Generator().manual_seed(3))
    for j, c in enumerate(starts):
        for s in range(samples):
            masked = chain.masks[chain.row[c - min(starts), s]].nonzero().flatten().tolist()
            want = (len(ids) - c) / len(masked) * sum(logp_masked(family_model, ids, set(masked), i) for i in masked)
            assert owner[j * samples + s] == j
            assert float(draws[j * samples + s]) == pytest.approx(want, abs=1e-5)


def independent_estimates(model, ids, starts, samples, generator):
    """The estimator before chained draws, as a reference: every split its own independent draws (``l``
    uniform, then a uniform ``l``-subset of its columns), every draw forwarded. Means and standard errors."""
    n = len(ids)
    means, errors = [], []
    for c in starts:
        length = n - c
        sizes = torch.randint(1, length + 1, (samples,), generator=generator)
        order = torch.rand(samples, length, generator=generator).argsort(dim=1)
        masks = torch.zeros(samples, n, dtype=torch.bool)
        masks[:, c:] = order.argsort(dim=1) < sizes[:, None]
        fed = torch.where(masks, model.config.mask_token_id, torch.tensor(ids).expand(samples, -1))
        with torch.inference_mode():
            logp = torch.log_softmax(model.logits(model(fed, torch.arange(n).expand(samples, -1)).hidden), dim=-1)
        true = logp.gather(-1, torch.tensor(ids).expand(samples, -1)[..., None])[..., 0].double()
        draws = (true * masks).sum(1) * length / sizes
        means.append(float(draws.mean()))
        errors.append(float(draws.std()) / math.sqrt(samples))
    return means, errors


def test_chained_estimates_agree_with_independent_draws_within_their_error(family_model):
    if family_model.block_causal:  # the reference draws whole-sequence masks, which it no longer scores
        pytest.skip("a block-causal model is scored block by block (test_a_block_causal_model_is_scored_...)")
    ids = unmasked(family_model, 9, seed=9)
    starts, samples = list(range(1, 9)), 800
    old, old_err = independent_estimates(family_model, ids, starts, samples, torch.Generator().manual_seed(1))
    draws, owner = bound_draws(family_model, ids, starts, samples, torch.Generator().manual_seed(2))
    for j, c in enumerate(starts):
        mine = draws[owner == j]
        new, new_err = float(mine.mean()), float(mine.std()) / math.sqrt(samples)
        assert new == pytest.approx(old[j], abs=4 * math.hypot(old_err[j], new_err)), c
        assert new_err == pytest.approx(old_err[j], rel=0.25)  # the same distribution: the same spread


def test_chained_draws_forward_about_half_the_rows():
    n, samples = 48, 32
    rows, _ = _plan(list(range(n)), range(1, n), samples, torch.Generator().manual_seed(0), 1, 1)
    independent = (n - 1) * samples + (n - 1)  # a row a (split, sample), and one a position for its top tokens
    assert len(rows.masks) < 0.55 * independent


def test_jobs_scored_together_get_what_each_gets_alone(family_model):
    a, b, c = random_prompts([10, 10, 7], vocab=family_model.config.vocab_size - 2, seed=10)
    specs = [(a, 1, 6, 1, 2), (b, 3, 4, 2, 0), (c, 2, 5, 3, 3), (a, 9, 3, 4, 1)]
    together = score_jobs(family_model, [ScoreJob(ids, start, samples, torch.Generator().manual_seed(seed), k)
                                         for ids, start, samples, seed, k in specs], batch_size=5)
    for (ids, start, samples, seed, k), got in zip(specs, together, strict=True):
        alone = token_logprobs(family_model, ids, start, samples, torch.Generator().manual_seed(seed), k)
        assert got.start == alone.start and got.token_ids == alone.token_ids
        assert got.values == pytest.approx(alone.values, abs=1e-5)
        assert [list(t) for t in got.top] == [list(t) for t in alone.top]
        for mine, theirs in zip(got.top, alone.top, strict=True):
            assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-5)
            assert len(mine) == k


def test_a_forward_takes_no_more_tokens_than_the_engine_step_cap(family_model):
    from acache.scoring import ScoreJob, score_jobs

    ids = unmasked(family_model, 10, seed=11)
    rows = []
    forward = type(family_model).forward

    def counting(self, x, *args, **kwargs):
        rows.append(x.shape[0])
        return forward(self, x, *args, **kwargs)

    job = ScoreJob(ids, 2, 6, torch.Generator().manual_seed(1))
    want = score_jobs(family_model, [job])[0]
    type(family_model).forward = counting
    try:
        got = score_jobs(family_model, [ScoreJob(ids, 2, 6, torch.Generator().manual_seed(1))], batch_tokens=30)[0]
    finally:
        type(family_model).forward = forward
    assert max(rows) == 3 and got.values == pytest.approx(want.values, abs=1e-5)


@pytest.fixture(scope="module")
def blocks_of_four(tmp_path_factory):
    """A block-causal model whose attention blocks are four columns long, so that short sequences cross them."""
    from acache.models.loader import load_model
    from tests.conftest import tiny_checkpoint

    return load_model(tiny_checkpoint(tmp_path_factory.mktemp("blocks4"), "fast_dllm_v2", block_size=4))


def test_a_block_causal_model_is_scored_block_by_block_with_the_blocks_before_clean(blocks_of_four):
    """Its decoding reads a block given the blocks before it, unmasked: a continuation of one token a block is
    then exact whatever the draws (the whole-sequence bound masked the earlier block's token too, and missed the
    per-block bound by 4-11 nats in the reviewer's case), and longer blocks converge to the sum of their bounds."""
    model = blocks_of_four
    ids = unmasked(model, 9, seed=2)  # columns 7 | 8: one continuation token in each of two blocks
    want = [logp_masked(model, ids[:8], {7}, 7), logp_masked(model, ids, {8}, 8)]
    for seed, samples in [(0, 1), (3, 4)]:
        scored = token_logprobs(model, ids, 7, samples, torch.Generator().manual_seed(seed))
        assert scored.values == pytest.approx(want, abs=1e-5)
        got = continuation_logprob(model, ids[:7], ids[7:], samples, torch.Generator().manual_seed(seed))
        assert got == pytest.approx(sum(want), abs=1e-5)
    ids = unmasked(model, 10, seed=3)  # columns 5 6 7 | 8 9
    bound = exact_bound(model, ids[:8], 5) + exact_bound(model, ids, 8)
    draws, _ = bound_draws(model, ids, [5], 20_000, torch.Generator().manual_seed(0), batch_size=512)
    stderr = float(draws.std()) / math.sqrt(len(draws))
    assert float(draws.mean()) == pytest.approx(bound, abs=4 * stderr)
    assert abs(exact_bound(model, ids, 5) - bound) > 8 * stderr  # the whole-sequence bound is another number


def is_greedy(values, tops):
    """lm-eval's reading of a continuation's logprobs: every token's value the highest of its top tokens."""
    return all(value == max(top.values()) for value, top in zip(values, tops, strict=True))


def test_greedy_tokens_read_as_greedy_and_others_do_not(family_model):
    """lm-eval's ``is_greedy`` (lambada's accuracy, multiple choice's exact match) compares each token's value with
    its top tokens: a telescoped value against a row's log-probability never matched, so every continuation of
    more than one token read as not greedy, even the model's own greedy decoding of it."""
    ids = unmasked(family_model, 10, seed=3)
    mask = family_model.config.mask_token_id
    for c in range(6, 10):  # the greedy token at each position, its row masking it and all after it
        [top] = token_logprobs(family_model, ids, c, 1, torch.Generator(), top_k=1).top[:1]
        best = next(iter(top))
        assert best != mask
        ids[c] = best
    scored = token_logprobs(family_model, ids, 6, 4, torch.Generator().manual_seed(1), top_k=1)  # lm-eval's ask
    assert scored.top == [{t: v} for t, v in zip(ids[6:], scored.values, strict=True)]
    assert is_greedy(scored.values, scored.top)
    three = token_logprobs(family_model, ids, 6, 4, torch.Generator().manual_seed(1), top_k=3)
    assert all(len(top) == 3 and top[t] == v for t, v, top in zip(ids[6:], three.values, three.top, strict=True))
    ids[8] = next(t for t in range(1, 50) if t not in (ids[8], mask))  # one token that is not its row's first
    for k in (1, 3):
        scored = token_logprobs(family_model, ids, 6, 4, torch.Generator().manual_seed(1), top_k=k)
        assert not is_greedy(scored.values, scored.top) and len(scored.top[2]) == k
        assert scored.values[2] not in scored.top[2].values()


def test_a_block_causal_split_gets_the_draws_it_gets_scored_alone(blocks_of_four):
    model = blocks_of_four
    ids = unmasked(model, 11, seed=4)
    scored = token_logprobs(model, ids, 2, 5, torch.Generator().manual_seed(9), top_k=2)
    assert len(scored.values) == len(scored.top) == 9
    together = split_estimates(model, ids, range(2, 11), 5, torch.Generator().manual_seed(9))
    for c in range(2, 11):
        assert sum(scored.values[c - 2:]) == pytest.approx(together[c - 2], abs=1e-5)
        alone = split_estimates(model, ids, [c], 5, torch.Generator().manual_seed(9))[0]
        assert sum(scored.values[c - 2:]) == pytest.approx(alone, abs=1e-5)
    # the top tokens at column 6: its block's prediction with it and the rest of the block masked
    fed = torch.tensor([[model.config.mask_token_id if i >= 6 else t for i, t in enumerate(ids[:8])]])
    with torch.inference_mode():
        dist = torch.log_softmax(model.logits(model(fed, torch.arange(8)[None]).hidden), -1)[0, 6]
    assert list(scored.top[4]) == dist.topk(2).indices.tolist()
