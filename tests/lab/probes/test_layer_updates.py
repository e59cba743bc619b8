"""The layer-update probe: what each layer adds to the residual stream, zero for a deepened model's silent layers."""

from __future__ import annotations

import re

import pytest
import torch

from acache.models.loader import load_model
from acache_lab.probes.layer_updates import layer_updates, task_prompts_in_context
from acache_lab.train.expand import expand_layers


def test_silent_layers_add_nothing_and_the_others_what_they_did(llada_dir):
    """A deepened model's inserted layers write exactly nothing; its original layers write what they wrote before
    the expansion, since every state they read is the same."""
    model = load_model(llada_dir)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 9)]
    before = layer_updates(model, prompts)
    after = layer_updates(expand_layers(model), prompts)
    assert len(before) == 2 and all(u > 1e-3 for u in before)
    assert after[1::2] == [0.0, 0.0]
    assert after[0::2] == pytest.approx(before, rel=1e-5)


def test_the_mean_is_over_tokens_not_prompts(llada_dir):
    """Two prompts weigh by their lengths: the mean of a 3-token and a 9-token prompt is 3/12 and 9/12 of theirs."""
    model = load_model(llada_dir)
    short, long = [4, 5, 6], list(range(4, 13))
    both = layer_updates(model, [short, long])
    each = [layer_updates(model, [p]) for p in (short, long)]
    assert both == pytest.approx([(3 * a + 9 * b) / 12 for a, b in zip(*each, strict=True)], rel=1e-6)


def test_no_prompt_or_an_empty_one_is_refused(llada_dir):
    model = load_model(llada_dir)
    for prompts in ([], [[4, 5], []]):
        with pytest.raises(ValueError, match="at least one prompt, none of them empty"):
            layer_updates(model, prompts)


def test_task_prompts_mask_the_answer_columns():
    from acache.models.checkpoint import SPECIAL_TOKENS
    from acache_lab.tasks.generators import held_out
    from acache_lab.tasks.render import ANSWER_LENGTHS, build_word_tokenizer

    tok = build_word_tokenizer()
    mask = tok.token_to_id(SPECIAL_TOKENS["llada"]["mask"])
    for task in ("qa1", "arith"):
        (prompt,) = task_prompts_in_context(tok, held_out(task, 1, 4), mask, tok.token_to_id("[UNK]"))
        first = prompt.index(mask)
        assert prompt[first:] == [mask] * ANSWER_LENGTHS[task]  # the prefix layout's generation region is last
        assert prompt[first - 2:first] == [tok.token_to_id("answer"), tok.token_to_id(":")]
        assert prompt[0] == tok.token_to_id("story")


@pytest.mark.parametrize(("argv", "message"), [(["--examples", "0"], "at least 1"),
                                               (["--sentences", "0"], "at least 1")])
def test_bad_arguments_are_refused_before_any_model_loads(monkeypatch, capsys, argv, message):
    from acache_lab.probes import layer_updates as probe

    monkeypatch.setattr("sys.argv", ["layer_updates", "--model", "no/such/model", *argv])
    with pytest.raises(SystemExit):
        probe.main()
    assert re.search(message, capsys.readouterr().err)
