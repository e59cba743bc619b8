"""The reference path refuses what it does not run, rather than decoding without it."""

from __future__ import annotations

import pytest

from acache.reference import reference_generate
from acache.sampling_params import SamplingParams


def test_focus_is_refused_not_ignored(llada_model):
    params = SamplingParams(gen_length=8, block_length=8, focus_layers=1)
    with pytest.raises(ValueError, match="focus_layers is not run by the reference path"):
        reference_generate(llada_model, [1, 2, 3], params)
    # the same request without FOCUS decodes: the refusal is of the option, not of the request
    assert len(reference_generate(llada_model, [1, 2, 3], SamplingParams(gen_length=8, block_length=8)).token_ids) <= 8
