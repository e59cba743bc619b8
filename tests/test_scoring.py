"""The Monte Carlo log-likelihood bound: exact where it has no randomness, unbiased where it has, seeded,
and the telescoped per-token values add up to each split's estimate."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from acache.scoring import continuation_logprob, split_estimates, token_logprobs
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


def test_one_token_continuation_is_exact_whatever_the_draws(family_model):
    ids = random_prompts([9], vocab=family_model.config.vocab_size - 2)[0]
    want = logp_masked(family_model, ids, {8}, 8)
    for seed, samples in [(0, 1), (1, 5), (7, 3)]:
        got = continuation_logprob(family_model, ids[:8], ids[8:], samples, torch.Generator().manual_seed(seed))
        assert got == pytest.approx(want, abs=1e-5)


def test_the_estimate_converges_to_the_bound(family_model):
    ids = random_prompts([8], vocab=family_model.config.vocab_size - 2, seed=3)[0]
    want = exact_bound(family_model, ids, 5)
    got = continuation_logprob(family_model, ids[:5], ids[5:], 3000, torch.Generator().manual_seed(0), batch_size=512)
    few = [continuation_logprob(family_model, ids[:5], ids[5:], 4, torch.Generator().manual_seed(s))
           for s in range(40)]
    spread = float(torch.tensor(few).std())
    assert spread > 0  # three tokens: the draws matter
    assert got == pytest.approx(want, abs=4 * spread / math.sqrt(3000 / 4))


def test_a_seed_fixes_the_estimate_and_another_changes_it(family_model):
    ids = random_prompts([10], vocab=family_model.config.vocab_size - 2, seed=4)[0]
    one = continuation_logprob(family_model, ids[:4], ids[4:], 6, torch.Generator().manual_seed(11))
    again = continuation_logprob(family_model, ids[:4], ids[4:], 6, torch.Generator().manual_seed(11))
    other = continuation_logprob(family_model, ids[:4], ids[4:], 6, torch.Generator().manual_seed(12))
    assert one == again != other


def test_telescoped_values_add_up_to_each_split(family_model):
    ids = random_prompts([12], vocab=family_model.config.vocab_size - 2, seed=5)[0]
    scored = token_logprobs(family_model, ids, 2, 5, torch.Generator().manual_seed(9), top_k=3, batch_size=7)
    again = split_estimates(family_model, ids, range(2, 12), 5, torch.Generator().manual_seed(9))
    assert len(scored.values) == len(scored.top) == 10
    # the same forwards in batches of another size: float-close, not bit-equal (a CPU's matmul kernels block a
    # batch by its size: on an AMD EPYC the sums differ in the 8th digit even under one key mask)
    for c in range(2, 12):
        assert sum(scored.values[c - 2:]) == pytest.approx(again[c - 2], abs=1e-5)
    # the top tokens at a position: its prediction with it and all after it masked
    last = logp_masked(family_model, ids, set(range(7, 12)), 7)
    assert scored.top[5].get(ids[7], last) == pytest.approx(last, abs=1e-5)
    assert list(scored.top[5].values()) == sorted(scored.top[5].values(), reverse=True)
    assert max(scored.top[5].values()) >= last - 1e-5


def test_batch_size_does_not_change_the_estimate(family_model):
    ids = random_prompts([10], vocab=family_model.config.vocab_size - 2, seed=6)[0]
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


def test_a_set_cancel_event_stops_scoring(family_model):
    import threading

    from acache.scoring import ScoringCancelled

    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ScoringCancelled):
        split_estimates(family_model, [1, 2, 3, 4], [1, 2], 3, torch.Generator(), cancel=cancel)
    with pytest.raises(ScoringCancelled):
        token_logprobs(family_model, [1, 2, 3, 4], 1, 3, torch.Generator(), top_k=2, cancel=cancel)
