"""Far-mask pruning (``far_mask_window``): its definition on a hand-built request, its no-op window, and the
engine against the reference path with mixed windows arriving at different steps."""

from __future__ import annotations

import pytest
import torch

from acache.decoding.canvas import Layout
from acache.decoding.request_state import Phase, RequestState
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.affix.helpers import layouts
from tests.conftest import random_prompts
from tests.helpers import block_causal, run_engine, tokens


def state(window, cache="dual", suffix=()):
    prompt = tuple(range(10, 16)) + tuple(suffix)
    s = RequestState(Layout(prompt, 6), SamplingParams(gen_length=32, block_length=8, cache=cache,
                                                       far_mask_window=window), 99, 98, False, torch.device("cpu"))
    s.admit()
    return s


def cols(t):
    return set(t.tolist())


def test_far_blocks_are_neither_fed_nor_attended():
    """Prompt 0-5, four blocks of 8 (6-13, 14-21, 22-29, 30-37), two suffix tokens 38-39; window 1."""
    s = state(1, suffix=(20, 21))
    far = cols(torch.arange(22, 38))
    refresh = s.plan()
    assert refresh.refresh and cols(refresh.fed) == set(range(40)) - far and not cols(refresh.past)
    s.phase = Phase.STEP
    step = s.plan()
    assert cols(step.fed) == set(range(6, 14)) and cols(step.past) == set(range(40)) - far - set(range(6, 14))
    s.block, s.phase = 2, Phase.REFRESH  # the window has reached every block: nothing is far
    assert not bool(s.far_columns().any()) and cols(s.plan().fed) == set(range(40))
    s.block, s.phase = 1, Phase.STEP
    assert cols(s.plan().past) == set(range(40)) - set(range(14, 22)) - set(range(38 - 8, 38))
    for cache in ("none", "prefix"):
        s = state(0, cache)
        if cache == "prefix":
            s.phase = Phase.STEP
        plan = s.plan()
        assert cols(plan.fed) & set(range(14, 38)) == set() and 6 in cols(plan.fed)
        assert [int(plan.fed[i]) for i in plan.block] == list(range(6, 14))


def test_a_window_that_covers_every_block_changes_nothing(family_model):
    prompts = random_prompts([7, 12, 3], seed=11)
    base = dict(gen_length=32, block_length=8, threshold=0.5)
    want = run_engine(family_model, prompts, SamplingParams(**base))
    got = run_engine(family_model, prompts, SamplingParams(**base, far_mask_window=3))
    assert tokens(got) == tokens(want)
    pruned = run_engine(family_model, prompts, SamplingParams(**base, far_mask_window=0))
    if block_causal(family_model):  # later blocks are invisible to a block-causal model: pruning them is exact
        assert tokens(pruned) == tokens(want)
    else:
        assert tokens(pruned) != tokens(want)  # non-vacuity: on this model the far masks do matter


def test_the_engine_equals_the_reference_with_mixed_windows(family_model):
    prompts = [layouts(seed=s)[k] for s in range(2) for k in ("prefix", "suffix", "two-affix")]
    params = []
    for i in range(len(prompts)):
        reuse = i % 2 == 1
        params.append(SamplingParams(gen_length=(16, 32)[i % 2], block_length=8, threshold=0.5,
                                     far_mask_window=(None, 0, 1)[i % 3], selector="attention" if reuse else None,
                                     cache="prefix" if not reuse and i % 3 == 2 else "dual"))
    outs = run_engine(family_model, prompts, params, arrivals=[0, 0, 1, 3, 4, 4])
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out.token_ids == reference_generate(family_model, prompt, p).token_ids


@pytest.mark.parametrize("field, value, why", [("far_mask_window", -1, "non-negative integer"),
                                               ("far_mask_window", 1.5, "non-negative integer"),
                                               ("far_mask_window", True, "non-negative integer"),
                                               ("focus_layers", 0, "at least 1"),
                                               ("focus_ratio", 0.0, r"focus_ratio must be in \(0, 1\]"),
                                               ("focus_ratio", 1.5, r"focus_ratio must be in \(0, 1\]")])
def test_bad_pruning_parameters_are_refused(field, value, why):
    with pytest.raises(ValueError, match=why):
        SamplingParams(**{field: value})
    if field == "focus_layers":
        with pytest.raises(ValueError, match="set cache='dual'"):
            SamplingParams(focus_layers=1, cache="prefix")


@pytest.mark.parametrize("policy", ["attention", "influence", "cacheblend"])
def test_selection_reads_only_the_columns_inside_the_window(family_model, policy):
    """ACache's selection reads what the first refresh reads: with window 1 and blocks of 8, the anchors of a
    32-column region are those of the same prompts with a 16-column region (the columns before the region sit at
    the same positions either way), and differ from the unwindowed ones on some prompt wherever the masks' queries
    vote or the affix attends to masks. Questions of three lengths pad the batch."""
    # a block-causal model's prefix affix is exact and takes no anchors: its infix affix does, and the region is
    # still after every prompt column
    layout = "infix" if block_causal(family_model) else "prefix"
    prompts = [layouts(question_len=q, seed=s)[layout] for s, q in enumerate((4, 6, 9))]
    base = dict(block_length=8, threshold=0.5, selector=policy, anchor_ratio=0.2)
    windowed_params = SamplingParams(gen_length=32, far_mask_window=1, **base)
    windowed = run_engine(family_model, prompts, windowed_params)
    short = run_engine(family_model, prompts, SamplingParams(gen_length=16, **base))
    whole = run_engine(family_model, prompts, SamplingParams(gen_length=32, **base))
    assert [o.anchors for o in windowed] == [o.anchors for o in short]
    assert all(o.anchors for o in windowed + whole)
    if policy == "attention" or not block_causal(family_model):  # a block-causal affix sees no mask after it
        assert any(w.anchors != o.anchors for w, o in zip(windowed, whole, strict=True))
    for prompt, out in zip(prompts, windowed, strict=True):
        ref = reference_generate(family_model, prompt, windowed_params)
        assert (out.token_ids, out.anchors) == (ref.token_ids, ref.anchors)


def test_windows_block_lengths_probe_steps_and_bicache_mixed_in_one_batch(family_model):
    """Per-row windows on one selection canvas, the probe proposing first blocks of different lengths (a
    row's window can end before the longest), and BiCache's refresh under a window: each request as alone."""
    prompts = [layouts(question_len=q, seed=s)[k] for s, (q, k) in enumerate(
        [(4, "prefix"), (9, "infix"), (6, "suffix"), (5, "prefix"), (7, "two-affix"), (3, "infix")])]
    params = [SamplingParams(gen_length=32, block_length=(4, 16)[i % 2], threshold=0.5,
                             far_mask_window=(0, None, 1)[i % 3], anchor_ratio=0.2,
                             selector="bicache-matched" if i == 5 else "attention", probe_step=i < 4)
              for i in range(len(prompts))]
    outs = run_engine(family_model, prompts, params, arrivals=[0, 0, 0, 1, 2, 2])
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        ref = reference_generate(family_model, prompt, p)
        assert (out.token_ids, out.anchors) == (ref.token_ids, ref.anchors)
