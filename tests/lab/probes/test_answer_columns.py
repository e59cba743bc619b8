import pytest
import torch

from acache import LLM
from acache.paths import SHIPPED_MODEL
from acache_lab.eval.tasks import task_prompts
from acache_lab.probes.answer_columns import placement, readings
from acache_lab.tasks.generators import held_out


def test_readings_up_to_the_first_eos_and_with_every_eos_dropped():
    """None stands for EOS: an answer placed late reads empty up to the first EOS but right without the EOS; a
    repeated word is wrong either way."""
    assert readings(["cellar", None, None], ["cellar"]) == (True, True)
    assert readings([None, None, "cellar", None], ["cellar"]) == (False, True)
    assert readings(["cellar", "cellar", None], ["cellar"]) == (False, False)
    assert readings(["2", "+", None, "5"], ["2", "+", "5"]) == (False, True)
    assert readings(["kitchen"], ["kitchen"]) == (True, True)


def test_placement_reads_the_first_step_of_an_all_masked_region():
    """On the shipped model, qa1 in the prefix layout with one column of room: each request's first-step words are
    the argmax of one in-context forward over the prompt with the region masked, counted by column."""
    p = placement(SHIPPED_MODEL, "qa1", "prefix", 3, requests=4, seed=3)
    llm = LLM(SHIPPED_MODEL)
    examples = held_out("qa1", 4, 6, 3)
    columns, right = {}, 0
    for prompt, example in zip(task_prompts(llm, examples, "prefix"), examples, strict=True):
        ids = [*prompt.token_ids[:prompt.gen_at], *[llm.config.mask_token_id] * 3, *prompt.token_ids[prompt.gen_at:]]
        with torch.no_grad():
            logits = llm.model.logits(llm.model(torch.tensor([ids]), torch.arange(len(ids))[None]).hidden)
        best = logits[0, prompt.gen_at:prompt.gen_at + 3].argmax(-1).tolist()
        for i, t in enumerate(best):
            if t != llm.config.eos_token_id:
                columns[i] = columns.get(i, 0) + 1
        words = [llm.tokenizer.decode([t]) for t in best if t != llm.config.eos_token_id]
        right += words == list(example.answer)
    assert p.requests == 4 and dict(p.word_columns) == columns and p.right_without_eos == right
    # with one column of room the shipped model still puts the word first, so both readings agree
    assert columns == {0: 4} and p.right_to_first_eos == p.right_without_eos == right


def test_placement_refuses_a_room_shorter_than_the_region_before_loading():
    with pytest.raises(ValueError, match="gen_length"):
        placement("no/such/model", "qa1", "prefix", 1)
