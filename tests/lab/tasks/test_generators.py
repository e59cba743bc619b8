"""Task generators: deterministic per seed, answers right by an independent solver, rendered layouts."""

from __future__ import annotations

import random

import pytest

from acache.policies import LAYOUTS
from acache_lab.tasks.generators import NAMES, TASKS, bind, codebook, codes, count, examples, grab, held_out, holder
from acache_lab.tasks.render import ANSWER_LENGTHS, TWO_AFFIXES, answer_length, build_word_tokenizer, render


def sentences(words):
    out, cur = [], []
    for w in words:
        if w == ".":
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    return out


def solve(example):
    """Reads the context word by word, as a person would, and answers the question."""
    where, holder, holds = {}, {}, {}
    for s in sentences(example.affix):
        if len(s) == 5 and s[2:4] == ["to", "the"]:
            where[s[0]] = s[4]
        elif len(s) == 4 and s[1:3] == ["went", "to"]:
            holder[s[0]] = s[3]
        elif s[1] == "has":
            holds[(s[0], s[3])] = int(s[2])
            assert s[3] == example.question[2]  # the worksheet is about the item asked for
    q = example.question
    if example.task in ("qa1", "bind"):
        return (where[q[2]],)
    if example.task == "twohop":
        return (where[holder[q[3]]],)
    if example.task in ("holder", "grab"):
        return (holder[q[0]],)
    if example.task == "count":
        return (str(holds[(q[4], q[2])]),)
    item, a, b = q[2], q[4], q[6]
    x, y = min(holds[(a, item)], holds[(b, item)]), max(holds[(a, item)], holds[(b, item)])
    return (str(x), "+", str(y), "=", str(x + y))


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_per_seed(task):
    assert examples(task, 3, 20) == examples(task, 3, 20)
    assert examples(task, 3, 20) != examples(task, 4, 20)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("size", [2, 6, 10])
def test_answers_are_right_by_construction(task, size):
    exs = examples(task, seed=11, count=200, size=size)
    assert all(solve(e) == e.answer for e in exs)
    assert len({e.answer for e in exs}) > 3  # the answers vary


def test_qa1_answer_is_the_last_move_not_the_first():
    """A solver that took the first mention would fail on some stories: the task tests recency."""
    exs = examples("qa1", seed=5, count=200, size=8)

    def first_place(e):
        for s in sentences(e.affix):
            if s[0] == e.question[2]:
                return (s[4],)

    assert any(first_place(e) != e.answer for e in exs)


def test_layouts_and_tokenizer():
    tok = build_word_tokenizer()
    eos = tok.token_to_id("<|endoftext|>")

    def encode(text):
        return tok.encode(text, add_special_tokens=False).ids

    ex = examples("arith", 0, 1)[0]
    assert tok.token_to_id("[UNK]") not in encode(" ".join(ex.affix + ex.question + ex.answer))
    rendered = {layout: render(ex, layout, encode, eos) for layout in LAYOUTS}
    for layout, r in rendered.items():
        (span,) = r.prompt.affixes
        assert tok.decode(list(r.prompt.affix_ids(span))) == "story : " + " ".join(ex.affix)
        assert len(r.answer) == answer_length("arith") and tok.decode(list(r.answer)) == " ".join(ex.answer)
        assert r.answer[-1] == eos  # room for the EOS that ends the answer
        assert r.prompt.gen_at == (len(r.prompt.token_ids) - span.length if layout == "suffix"
                                   else len(r.prompt.token_ids))
    assert rendered["prefix"].prompt.affixes[0].start == 0
    assert rendered["infix"].prompt.affixes[0].start > 0


def test_every_answer_fits_its_task_region_with_an_eos():
    from acache_lab.tasks.generators import TRAIN_GENERATORS

    assert set(ANSWER_LENGTHS) == set(TRAIN_GENERATORS)
    for task in TRAIN_GENERATORS:
        longest = max(len(e.answer) for e in held_out(task, 200, 8, seed=3))
        assert longest + 1 == answer_length(task)  # tight: one EOS column, no more
    with pytest.raises(ValueError, match="unknown task 'qa9'"):
        answer_length("qa9")


def test_train_and_eval_streams_are_disjoint():
    evals = {e for task in TASKS for e in held_out(task, 100, 6)}
    train_rng = random.Random(0)
    from acache_lab.tasks.generators import GENERATORS

    train = set()
    for k in range(2000):
        task = TASKS[k % 3]
        train.update(GENERATORS[task](random.Random(f"train:{task}:{k}"), 6))
    assert not evals & train
    assert train_rng  # the training stream is seeded per draw, not by a shared generator


def test_bind_warm_up_mentions_each_person_once():
    rng = random.Random(3)
    for size in (2, 4, 8):
        for ex in bind(rng, size):
            people = [s[0] for s in sentences(ex.affix)]
            assert len(people) == len(set(people)) == size
            assert solve(ex) == ex.answer and ex.task == "bind"


def test_worksheets_name_each_person_once_and_count_asks_one_of_them():
    rng = random.Random(5)
    for size in (2, 5, 8):
        for ex in count(rng, size) + examples("arith", seed=size, count=3, size=size):
            people = [s[0] for s in sentences(ex.affix)]
            assert len(people) == len(set(people)) == size  # so a count is found by the name alone
            assert solve(ex) == ex.answer


def test_holder_warm_up_asks_twohop_first_hop_on_the_same_kind_of_story():
    rng = random.Random(7)
    for size in (5, 6, 9):
        exs = holder(rng, size)
        assert len({e.question[0] for e in exs}) == 2  # both objects are asked about
        for ex in exs:
            assert solve(ex) == ex.answer and ex.task == "holder"
            assert len(sentences(ex.affix)) == size


def test_grab_warm_up_gives_each_object_its_own_holder_and_nothing_else():
    rng = random.Random(9)
    for size in (2, 4, 6, 9):
        for ex in grab(rng, size):
            pickups = sentences(ex.affix)
            assert all(len(s) == 4 and s[1:3] == ["went", "to"] for s in pickups)  # no moves: one step
            holders, objects = [s[3] for s in pickups], [s[0] for s in pickups]
            assert len(set(holders)) == len(holders) == len(set(objects)) == min(size, 6)
            assert solve(ex) == ex.answer and ex.task == "grab"


def test_arith_writes_the_smaller_count_first_whatever_order_the_question_names_people():
    exs = examples("arith", seed=2, count=300)
    assert all(int(e.answer[0]) <= int(e.answer[2]) for e in exs)
    holds = [{s[0]: int(s[2]) for s in sentences(e.affix)} for e in exs]
    # the question names the larger count first in about half the questions: the order is the template's
    assert 0.3 < sum(h[e.question[4]] > h[e.question[6]] for h, e in zip(holds, exs, strict=True)) / len(exs) < 0.7


def solve_codes(example):
    """The code from the demonstrations (each "NAME is CODE ."), then the code of the person the request's
    own story gives the asked object."""
    code = {}
    for demo in sentences(example.affix):
        assert len(demo) == 3 and demo[1] == "is"
        code[demo[0]] = demo[2]
    holder = {s[0]: s[3] for s in sentences(example.context)}
    return (code[holder[example.question[0]]],)


@pytest.mark.parametrize("size", [1, 4, 8])
def test_codes_demonstrate_each_place_once_and_answer_in_their_code(size):
    rng = random.Random(13)
    sets = [codes(rng, size) for _ in range(60)]
    for exs in sets:
        assert len({e.affix for e in exs}) == 1 and len(exs) == 3  # the requests share one demonstration set
        demos = sentences(exs[0].affix)
        assert sorted(s[0] for s in demos) == sorted(NAMES)  # every person demonstrated, once
        assert len({s[2] for s in demos}) == len(NAMES)  # a one-to-one code
        for ex in exs:
            assert ex.task == "codes" and len(sentences(ex.context)) == min(size, 6)
            assert solve_codes(ex) == ex.answer
    # the code is the demonstrations' own: one place's number changes from set to set
    assert len({next(s[2] for s in sentences(e[0].affix) if s[0] == "mary") for e in sets}) > 10


def test_codes_render_the_demonstrations_as_the_affix_in_every_layout_and_as_two_affixes():
    tok = build_word_tokenizer()

    def encode(text):
        return tok.encode(text, add_special_tokens=False).ids

    ex = held_out("codes", 1, 4)[0]
    rendered = {layout: render(ex, layout, encode, 96) for layout in (*LAYOUTS, TWO_AFFIXES)}
    for layout in LAYOUTS:
        (span,) = rendered[layout].prompt.affixes
        assert tok.decode(list(rendered[layout].prompt.affix_ids(span))) == "worksheet : " + " ".join(ex.affix)
        text = tok.decode(list(rendered[layout].prompt.token_ids))
        assert "story : " + " ".join(ex.context) + " question : " + " ".join(ex.question) in text
    demos, story = rendered[TWO_AFFIXES].prompt.affixes
    assert tok.decode(list(rendered[TWO_AFFIXES].prompt.affix_ids(story))) == "story : " + " ".join(ex.context)
    assert (demos.start, story.start) == (0, demos.length)
    # two cached spans, the same tokens as the prefix layout
    assert rendered[TWO_AFFIXES].prompt.token_ids == rendered["prefix"].prompt.token_ids
    with pytest.raises(ValueError, match="needs a task with demonstrations; qa1 has none"):
        render(held_out("qa1", 1, 4)[0], TWO_AFFIXES, encode, 96)


def test_long_documents_reach_two_hundred_tokens():
    tok = build_word_tokenizer()
    ex = held_out("qa1", 1, 34)[0]
    r = render(ex, "prefix", lambda t: tok.encode(t, add_special_tokens=False).ids, 96)
    assert r.prompt.affixes[0].length >= 200 and len(r.prompt.token_ids) + len(r.answer) <= 256
    assert solve(ex) == ex.answer


def test_codebook_warm_up_asks_the_code_of_a_place_directly():
    rng = random.Random(17)
    for size in (1, 3):
        for ex in codebook(rng, size):
            demo = next(s for s in sentences(ex.affix) if s[0] == ex.question[0])
            assert ex.task == "codebook" and ex.question[1:] == ("is", "?") and ex.answer == (demo[2],)


def test_parse_tasks_checks_every_name_against_the_evaluable_tasks():
    from acache_lab.tasks.generators import parse_tasks

    assert parse_tasks(None) == TASKS
    assert parse_tasks("codes,qa1") == ("codes", "qa1")
    assert parse_tasks("qa1, qa1,arith") == ("qa1", "arith")  # each cell once (a repeat ran and printed twice)
    with pytest.raises(ValueError, match="unknown task 'bind'; known: qa1, arith, twohop, codes"):
        parse_tasks("qa1,bind")  # a training warm-up is not evaluated
