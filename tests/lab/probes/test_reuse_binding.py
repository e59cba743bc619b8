import pytest

from acache_lab.probes.reuse_binding import OUTCOMES, outcome, story_facts
from acache_lab.tasks.generators import Example, held_out


def words(text: str) -> tuple[str, ...]:
    return tuple(text.split(" "))


STORY = words("mary went to the kitchen . john moved to the garden . apple went to mary . hat went to john .")


def test_story_facts_read_the_holders_and_the_last_places():
    story = (*STORY, *words("mary travelled to the cellar ."))
    assert story_facts(story) == ({"apple": "mary", "hat": "john"}, {"mary": "cellar", "john": "garden"})


def test_every_generated_story_is_read_back_as_generated():
    """The parser agrees with the generator on held-out stories: each example's own answer is its object's."""
    for task in ("holder", "twohop"):
        for example in held_out(task, 40, 12, seed=3):
            assert outcome(example, example.answer) in OUTCOMES[:2]


def test_outcomes_tell_the_other_objects_answer_from_anything_else():
    twohop = Example("twohop", STORY, ("where", "is", "the", "apple", "?"), ("kitchen",))
    assert outcome(twohop, ["kitchen"]) == "right, answers differ"
    assert outcome(twohop, ["garden"]) == "the other object's answer"
    assert outcome(twohop, ["office"]) == "something else"
    assert outcome(twohop, ["kitchen", "garden"]) == "something else"
    holder = Example("holder", STORY, ("hat", "went", "to", "?"), ("john",))
    assert outcome(holder, ["mary"]) == "the other object's answer"
    same = Example("holder", (*STORY[:-5], *words("hat went to mary .")), ("hat", "went", "to", "?"), ("mary",))
    assert outcome(same, ["mary"]) == "right, both answers equal"


@pytest.mark.parametrize("example, problem", [
    (Example("qa1", STORY, ("where", "is", "mary", "?"), ("kitchen",)), "holder and twohop"),
    (Example("holder", STORY[:-5], ("hat", "went", "to", "?"), ("john",)), "two objects"),
    (Example("holder", (*STORY, "mary", "sang", "."), ("hat", "went", "to", "?"), ("john",)), "not a two-hop sentence"),
])
def test_a_story_the_probe_cannot_read_is_named(example, problem):
    with pytest.raises(ValueError, match=problem):
        outcome(example, ["john"])
