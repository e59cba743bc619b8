import pytest
import torch

import acache_lab.probes.answer_columns as probe
from acache import LLM
from acache.paths import REPO_ROOT, SHIPPED_MODEL
from acache_lab.probes.answer_columns import placement, readings


def test_readings_up_to_the_first_stop_and_with_every_stop_dropped():
    """An answer placed late reads empty up to the first stop token but right without the stop tokens; a repeated
    word is wrong either way; several tokens make one answer, compared word for word."""
    words = {1: "cellar", 2: "2", 3: "+", 4: "5", 9: "<eos>"}

    def decode(ids):
        return " ".join(words[t] for t in ids if t != 9)

    stops = {9}
    assert readings([1, 9, 9], stops, decode, ["cellar"]) == (True, True)
    assert readings([9, 9, 1, 9], stops, decode, ["cellar"]) == (False, True)
    assert readings([1, 1, 9], stops, decode, ["cellar"]) == (False, False)
    assert readings([2, 3, 9, 4], stops, decode, ["2", "+", "5"]) == (False, True)
    assert readings([1], stops, decode, ["cellar"]) == (True, True)


def test_placement_counts_where_the_first_step_puts_the_words(monkeypatch):
    """The shipped model puts qa1's word first when given two columns of room (right under both readings); with its
    predictions over the region moved two columns right, the probe finds the word in column 2 and reads the
    answers as empty up to the first EOS but right without it."""
    plain = placement(SHIPPED_MODEL, "qa1", "prefix", 4, requests=6, seed=3)
    assert dict(plain.word_columns) == {0: 6} and plain.right_to_first_eos == plain.right_without_eos == 6

    real = LLM

    def late(model):
        llm = real(model)
        logits = llm.model.logits
        llm.model.logits = lambda hidden, cols=None, valid=None: torch.roll(logits(hidden, cols, valid), 2, dims=1)
        return llm

    monkeypatch.setattr(probe, "LLM", late)
    moved = placement(SHIPPED_MODEL, "qa1", "prefix", 4, requests=6, seed=3)
    assert dict(moved.word_columns) == {2: 6} and moved.right_to_first_eos == 0 and moved.right_without_eos == 6


def test_placement_refuses_bad_input_before_loading():
    with pytest.raises(ValueError, match="gen_length"):
        placement("no/such/model", "qa1", "prefix", 1)
    with pytest.raises(ValueError, match="layout must be one of prefix, infix, suffix"):
        placement("no/such/model", "qa1", "sideways", 4)


def test_placement_refuses_models_it_cannot_read():
    """A block-causal model cannot read the story after its region; a state-cache family has no whole-canvas forward."""
    models = REPO_ROOT / "models"
    with pytest.raises(ValueError, match="block-causal: it cannot read text after its answer"):
        placement(str(models / "acache-tiny-blockdiff"), "qa1", "suffix", 4, requests=1)
    with pytest.raises(ValueError, match="carries a state, not a forward over the whole canvas"):
        placement(str(models / "acache-tiny-ssm"), "qa1", "prefix", 4, requests=1)
