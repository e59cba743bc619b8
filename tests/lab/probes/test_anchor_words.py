import re

import pytest

from acache_lab.probes.anchor_words import affix_indices, anchor_roles
from acache_lab.tasks.generators import Example, held_out


def words(text: str) -> tuple[str, ...]:
    return tuple(text.split(" "))


STORY = words("mary went to the kitchen . apple went to mary . hat went to john .")
TWOHOP = Example("twohop", STORY, ("where", "is", "the", "apple", "?"), ("kitchen",))
WORDS = ("story", ":", *STORY)


def test_each_anchor_is_named_by_its_sentence_and_word():
    """Header, a move (even one whose verb is "went"), the asked pickup's words, and the other pickup's."""
    # indices into WORDS: 1 ':', 3 'went' of the move, 8 'apple', 11 'mary' (asked holder), 12 '.', 15 'to' of hat
    roles = anchor_roles(TWOHOP, WORDS, [1, 3, 8, 11, 12, 15])
    assert roles == {"header": 1, "move": 1, "asked object": 1, "asked holder": 1, "asked .": 1, "other to": 1}


def test_generated_stories_have_one_asked_and_one_other_pickup():
    """Every token of a held-out story as an anchor: the asked and the other pickup sentence are found once each,
    five words apiece, and everything else is a move or the header."""
    for example in held_out("twohop", 20, 8, seed=5):
        words = ("story", ":", *example.affix)
        roles = anchor_roles(example, words, range(len(words)))
        for side in ("asked", "other"):
            assert [roles[f"{side} {w}"] for w in ("object", "went", "to", "holder", ".")] == [1] * 5
        assert roles["header"] == 2 and sum(roles.values()) == len(words)


@pytest.mark.parametrize(("example", "words", "anchors", "message"), [
    (Example("holder", STORY, ("apple", "went", "to", "?"), ("mary",)), WORDS, [2], "twohop examples"),
    (TWOHOP, STORY, [2], "the affix's"),
    (TWOHOP, WORDS, [len(WORDS)], "outside the affix"),
    (TWOHOP, WORDS, [-1], "outside the affix"),
])
def test_bad_input_is_refused_by_name(example, words, anchors, message):
    with pytest.raises(ValueError, match=message):
        anchor_roles(example, words, anchors)


def test_anchor_positions_map_to_affix_tokens_in_every_layout():
    """Before the generation region a position is its prompt index; after it (the suffix layout's affix) it is
    ``gen_length`` further on. A position in the generation region or outside the affix is refused."""
    # prefix: affix tokens 0..9, question 10..13, 2 masks at positions 14-15
    assert affix_indices([0, 9], gen_at=14, gen_length=2, start=0, length=10) == [0, 9]
    # suffix: question 0..5, masks at positions 6-7, affix tokens 6..15 at positions 8..17
    assert affix_indices([8, 17], gen_at=6, gen_length=2, start=6, length=10) == [0, 9]
    for bad in (6, 7, 18, 5):
        with pytest.raises(ValueError, match="not in the affix"):
            affix_indices([bad], gen_at=6, gen_length=2, start=6, length=10)


@pytest.mark.parametrize(("argv", "message"), [
    (["--selector", "none"], "must choose anchors"),
    (["--selector", "nope"], "must choose anchors"),
    (["--layouts", "middle"], "unknown layout 'middle'"),
    (["--examples", "0"], "at least 1"),
    (["--sentences", "0"], "at least 1"),
    (["--ratio", "0"], r"in \(0, 1\]"),
])
def test_bad_arguments_are_refused_before_any_model_loads(monkeypatch, capsys, argv, message):
    from acache_lab.probes import anchor_words

    monkeypatch.setattr("sys.argv", ["anchor_words", "--model", "no/such/model", *argv])
    with pytest.raises(SystemExit):
        anchor_words.main()
    assert re.search(message, capsys.readouterr().err)
