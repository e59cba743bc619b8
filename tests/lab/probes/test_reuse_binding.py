import pytest

from acache_lab.probes.reuse_binding import outcome, story_facts
from acache_lab.tasks.generators import Example, held_out


def words(text: str) -> tuple[str, ...]:
    return tuple(text.split(" "))


STORY = words("mary went to the kitchen . john moved to the garden . apple went to mary . hat went to john .")


def test_story_facts_read_the_holders_and_the_last_places():
    story = (*STORY, *words("mary travelled to the cellar ."))
    assert story_facts(story) == ({"apple": "mary", "hat": "john"}, {"mary": "cellar", "john": "garden"})


def test_every_generated_story_is_read_back_as_generated():
    """The parser agrees with the generator on held-out stories of every length: each example's object leads to
    its own answer, and the other object's answer, given instead, is named as such unless the two are equal."""
    for task in ("holder", "twohop"):
        for sentences in (5, 12, 34):
            for example in held_out(task, 30, sentences, seed=3):
                held_by, where = story_facts(example.affix)
                obj = example.question[0] if task == "holder" else example.question[3]
                assert [held_by[obj] if task == "holder" else where[held_by[obj]]] == list(example.answer)
                other = next(o for o in held_by if o != obj)
                alternative = held_by[other] if task == "holder" else where[held_by[other]]
                if [alternative] == list(example.answer):
                    assert outcome(example, [alternative]) == "right, both answers equal"
                else:
                    assert outcome(example, example.answer) == "right, answers differ"
                    assert outcome(example, [alternative]) == "the other object's answer"


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
    # two holders in one place: two-hop's answers are equal though the holders differ
    together = Example("twohop", (*STORY, *words("john went to the kitchen .")), ("where", "is", "the", "hat", "?"),
                       ("kitchen",))
    assert outcome(together, ["kitchen"]) == "right, both answers equal"


@pytest.mark.parametrize("example, problem", [
    (Example("qa1", STORY, ("where", "is", "mary", "?"), ("kitchen",)), "holder and twohop"),
    (Example("holder", STORY[:-5], ("hat", "went", "to", "?"), ("john",)), "two objects"),
    (Example("holder", (*STORY, "mary", "sang", "."), ("hat", "went", "to", "?"), ("john",)), "not a two-hop sentence"),
    (Example("holder", STORY[:-1], ("hat", "went", "to", "?"), ("john",)), "full stop"),
    (Example("twohop", (*STORY, *words("hat went to lucas .")), ("where", "is", "the", "hat", "?"), ("x",)),
     "places every holder"),
])
def test_a_story_the_probe_cannot_read_is_named(example, problem):
    with pytest.raises(ValueError, match=problem):
        outcome(example, ["john"])
