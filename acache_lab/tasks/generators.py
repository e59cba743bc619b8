"""Three task families, each with a shared context (the affix), a question and a short answer.

* ``qa1`` — bAbI qa1-style stories: people move between places; "where is NAME ?" asks for the last
  place the story puts them (the paper's BABILong qa1 setting: the story is the affix).
* ``arith`` — a worksheet of quantities (who has how many of an item) is the affix; the question asks for
  the total two people hold, answered with a short worked sum "A + B = C".
* ``twohop`` — a story where people pick up objects and move; "where is the OBJECT ?" needs two facts at
  once: who last took the object, and where that person last went.
* ``codes`` — the paper's own setting, demonstrations as the affix: eight demonstrations ("mary is 17 .")
  give each person a number under a code drawn for that set; the request brings its own story of pickups
  and asks who took an object, answered with that person's number. The code exists only in the
  demonstrations; without them the model answers with the name.

Everything is a list of lowercase words from :data:`WORDS`, so a word-level tokenizer covers it exactly.
Each generator is deterministic in its ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

NAMES = ["mary", "john", "sandra", "daniel", "emma", "oliver", "lucas", "sofia"]
PLACES = ["kitchen", "garden", "office", "hallway", "bathroom", "bedroom", "cellar", "garage"]
MOVES = ["moved", "went", "travelled", "journeyed"]
OBJECTS = ["apple", "football", "milk", "book", "key", "hat"]
ITEMS = ["apples", "pears", "coins", "pencils", "stamps", "marbles"]
MAX_QUANTITY = 9  # single-digit counts: sums to 18, an addition table of 81 facts
#: the vocabulary's numbers reach 40, from the first worksheets' counts to 20, so run 8's checkpoints keep
#: their tokenizer and embedding shape
NUMBERS = [str(i) for i in range(41)]
#: "picked", "up", "together" and "worksheet" are in no task any more; they stay so that the
#: vocabulary, and with it a seed's initial weights, stays the same from run to run
FUNCTION_WORDS = ["to", "the", "where", "is", "?", ".", "has", "how", "many", "do", "and", "have", "picked",
                  "up", "together", "+", "=", "answer", ":", "story", "worksheet", "question"]
WORDS = sorted(set(NAMES + PLACES + MOVES + OBJECTS + ITEMS + NUMBERS + FUNCTION_WORDS))
TASKS = ("qa1", "arith", "twohop")
TRAIN_SEED_BASE = 0  # training draws from here upwards; held-out sets from EVAL_SEED_BASE, a disjoint stream
EVAL_SEED_BASE = 10**9


@dataclass(frozen=True)
class Example:
    task: str
    affix: tuple[str, ...]  # the shared context
    question: tuple[str, ...]
    answer: tuple[str, ...]
    #: the request's own context (its story, recomputed with its question), for tasks whose affix is
    #: demonstrations; in the two-affix layout it is a second affix
    context: tuple[str, ...] = ()
    #: what a two-hop question's first hop finds (``codes``: the holder whose code is asked), for the training-only
    #: bridge term (:mod:`acache_lab.train.bridge`); never part of a prompt or an answer
    bridge: tuple[str, ...] = ()


def _sentence(*words: str) -> list[str]:
    return [*words, "."]


def _pickup(obj: str, who: str) -> list[str]:
    """"apple went to lucas": the object is the sentence's first word. Every lookup the model learns finds
    its key there (a name, in qa1 and the worksheets); stated "lucas picked up the apple" or "the apple
    went to lucas", no run learned which object went with which holder (docs/model.md, runs 13-17)."""
    return _sentence(obj, "went", "to", who)


def _moves(rng: random.Random, sentences: int) -> tuple[list[str], dict[str, str]]:
    """A qa1 story: people move between places; and where each of them last went."""
    people = rng.sample(NAMES, k=min(len(NAMES), max(2, sentences // 2)))
    story: list[str] = []
    where: dict[str, str] = {}
    for _ in range(sentences):
        who = rng.choice(people)
        place = rng.choice([p for p in PLACES if p != where.get(who)])
        story += _sentence(who, rng.choice(MOVES), "to", "the", place)
        where[who] = place
    return story, where


def qa1(rng: random.Random, sentences: int = 6, questions: int = 3) -> list[Example]:
    """One story, several questions about people the story mentions."""
    story, where = _moves(rng, sentences)
    asked = rng.sample(sorted(where), k=min(questions, len(where)))
    return [Example("qa1", tuple(story), ("where", "is", who, "?"), (where[who],)) for who in asked]


def _worksheet(rng: random.Random, facts: int) -> tuple[str, dict[str, int], list[str]]:
    """An item, how many of it each of ``facts`` people has, and the worksheet's words."""
    item = rng.choice(ITEMS)
    people = rng.sample(NAMES, k=min(len(NAMES), max(2, facts)))
    holds = {who: rng.randint(1, MAX_QUANTITY) for who in people}
    return item, holds, [w for who in people for w in _sentence(who, "has", str(holds[who]), item)]


def arith(rng: random.Random, facts: int = 6, questions: int = 3) -> list[Example]:
    """One worksheet of how many of one item each person has; each question sums two people's counts.

    Each person appears once, so finding a count is a lookup by name alone (as in qa1); a worksheet where
    people held several items asked for a lookup by name and item at once, and run 8's model never learned
    it. The worked sum writes the smaller count first: written in the order the question names the people,
    the order was never learned, while smallest-first was learned in 1,000 steps (docs/model.md, runs 12-13)."""
    item, holds, sheet = _worksheet(rng, facts)
    out = []
    for _ in range(questions):
        a, b = rng.sample(list(holds), 2)
        x, y = sorted((holds[a], holds[b]))
        out.append(Example("arith", tuple(sheet), ("how", "many", item, "do", a, "and", b, "have", "?"),
                           (str(x), "+", str(y), "=", str(x + y))))
    return out


def count(rng: random.Random, facts: int = 6, questions: int = 3) -> list[Example]:
    """arith's warm-up: one person's count from the worksheet, the lookup without the sum."""
    item, holds, sheet = _worksheet(rng, facts)
    asked = rng.sample(list(holds), k=min(questions, len(holds)))
    return [Example("count", tuple(sheet), ("how", "many", item, "do", who, "have", "?"), (str(holds[who]),))
            for who in asked]


def _errand_story(rng: random.Random, sentences: int) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Three people go places and two of them pick up objects: the story, where each person last went,
    and who picked up each object."""
    people = rng.sample(NAMES, k=3)
    objects = rng.sample(OBJECTS, k=2)
    story: list[str] = []
    where: dict[str, str] = {}
    held_by: dict[str, str] = {}
    for who in people:  # everyone starts somewhere
        where[who] = rng.choice(PLACES)
        story += _sentence(who, rng.choice(MOVES), "to", "the", where[who])
    for obj in objects:
        held_by[obj] = rng.choice(people)
        story += _pickup(obj, held_by[obj])
    for _ in range(max(0, sentences - len(people) - len(objects))):
        who = rng.choice(people)
        where[who] = rng.choice([p for p in PLACES if p != where[who]])
        story += _sentence(who, rng.choice(MOVES), "to", "the", where[who])
    return story, where, held_by


def twohop(rng: random.Random, sentences: int = 6, questions: int = 2) -> list[Example]:
    """People pick up objects and move; where an object is needs its holder and the holder's place."""
    story, where, held_by = _errand_story(rng, sentences)
    asked = rng.sample(list(held_by), k=min(questions, len(held_by)))
    return [Example("twohop", tuple(story), ("where", "is", "the", obj, "?"), (where[held_by[obj]],))
            for obj in asked]


def holder(rng: random.Random, sentences: int = 6, questions: int = 2) -> list[Example]:
    """twohop's warm-up: its first hop alone, who took the object ("apple went to ?" -> "lucas")."""
    story, _, held_by = _errand_story(rng, sentences)
    asked = rng.sample(list(held_by), k=min(questions, len(held_by)))
    return [Example("holder", tuple(story), (obj, "went", "to", "?"), (held_by[obj],))
            for obj in asked]


def bind(rng: random.Random, sentences: int = 4, questions: int = 3) -> list[Example]:
    """qa1's warm-up: every person moves exactly once, so the answer needs the name-to-place binding
    but not "the last of several moves" (a curriculum stage; docs/model.md, run 7)."""
    people = rng.sample(NAMES, k=min(len(NAMES), max(2, sentences)))
    where = {who: rng.choice(PLACES) for who in people}
    story = [w for who in people for w in _sentence(who, rng.choice(MOVES), "to", "the", where[who])]
    asked = rng.sample(people, k=min(questions, len(people)))
    return [Example("bind", tuple(story), ("where", "is", who, "?"), (where[who],)) for who in asked]


def grab(rng: random.Random, sentences: int = 4, questions: int = 2) -> list[Example]:
    """holder's warm-up, as bind is qa1's: each person picks up one object and nothing else happens, so the
    answer needs the object-to-person binding and no other step. Every object has its own holder, so
    naming any person who picked something up is right by chance only (docs/model.md, runs 14-15)."""
    objects = rng.sample(OBJECTS, k=min(len(OBJECTS), max(2, sentences)))
    held_by = dict(zip(objects, rng.sample(NAMES, k=len(objects)), strict=True))
    story = [w for obj in objects for w in _pickup(obj, held_by[obj])]
    asked = rng.sample(objects, k=min(questions, len(objects)))
    return [Example("grab", tuple(story), (obj, "went", "to", "?"), (held_by[obj],)) for obj in asked]


def codes(rng: random.Random, sentences: int = 4, questions: int = 3) -> list[Example]:
    """Demonstrations as the affix, defining the answer's form: each person's number under a code drawn for
    this set ("mary is 17 .", one a person); ``questions`` requests share the set, each with its own story
    of ``sentences`` pickups ("apple went to mary .") and the question of ``holder`` ("apple went to ?"),
    answered not with the name, as without the demonstrations, but with its number in the set's code.

    The person comes first in the demonstrations, where every lookup this model learned finds its key (see
    :func:`_pickup`): three first versions keyed by place ("mary went to the kitchen . where is mary ? 17 .",
    "where is the kitchen ? 17 ." and "kitchen is 17 ." with a qa1 story) stayed at chance for 8,000 steps
    each, as objects did as keys in runs 14-20 (docs/model.md)."""
    code = dict(zip(NAMES, rng.sample(range(1, len(NUMBERS)), len(NAMES)), strict=True))
    demos = [w for who in rng.sample(NAMES, len(NAMES)) for w in _sentence(who, "is", str(code[who]))]
    out = []
    for _ in range(questions):
        objects = rng.sample(OBJECTS, k=min(len(OBJECTS), max(1, sentences)))
        held_by = dict(zip(objects, rng.sample(NAMES, k=len(objects)), strict=True))
        story = [w for obj in objects for w in _pickup(obj, held_by[obj])]
        obj = rng.choice(objects)
        out.append(Example("codes", tuple(demos), (obj, "went", "to", "?"), (str(code[held_by[obj]]),),
                           context=tuple(story), bridge=(held_by[obj],)))
    return out


def codebook(rng: random.Random, sentences: int = 4, questions: int = 3) -> list[Example]:
    """codes' warm-up, as ``count`` is arith's: its second hop alone, the question names the person ("mary is
    ?" -> "17") beside a story that does not matter."""
    out = []
    for ex in codes(rng, sentences, questions):
        who = rng.choice(NAMES)
        code = dict(zip(ex.affix[0::4], ex.affix[2::4], strict=True))  # "NAME is CODE ." four words each
        out.append(Example("codebook", ex.affix, (who, "is", "?"), (code[who],), context=ex.context))
    return out


#: the tasks whose examples carry a first hop (``Example.bridge``) for the bridge term
BRIDGED_TASKS = ("codes",)
GENERATORS = {"qa1": qa1, "arith": arith, "twohop": twohop, "codes": codes}
#: the tasks whose affix is demonstrations (the paper's setting); the others' affix is their document
DEMO_TASKS = ("codes",)
#: every task a study can evaluate
EVAL_TASKS = TASKS + DEMO_TASKS
#: Training-only warm-ups, never evaluated.
WARMUPS = {"bind": bind, "count": count, "holder": holder, "grab": grab, "codebook": codebook}
TRAIN_GENERATORS = GENERATORS | WARMUPS


def parse_tasks(text: str | None) -> tuple[str, ...]:
    """A command line's comma-separated ``--tasks`` (None: the shipped model's three), each checked."""
    tasks = tuple(dict.fromkeys(t.strip() for t in text.split(","))) if text else TASKS
    bad = [t for t in tasks if t not in EVAL_TASKS]
    if bad:
        raise ValueError(f"unknown task {bad[0]!r}; known: {', '.join(EVAL_TASKS)}")
    return tasks


def examples(task: str, seed: int, count: int, size: int = 6) -> list[Example]:
    """``count`` examples of ``task`` from contexts of ``size`` sentences, deterministic in ``seed``."""
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    rng = random.Random(f"{task}:{seed}")
    out: list[Example] = []
    while len(out) < count:
        out.extend(GENERATORS[task](rng, size))
    return out[:count]


def held_out(task: str, count: int, sentences: int, seed: int = 0) -> list[Example]:
    """``count`` examples from the evaluation seed stream, which training never draws from."""
    out: list[Example] = []
    for story in held_out_stories(task, sentences, seed):
        out.extend(story)
        if len(out) >= count:
            return out[:count]
    raise AssertionError("the story stream is endless")


def held_out_stories(task: str, sentences: int, seed: int = 0) -> Iterator[list[Example]]:
    """The evaluation seed stream one context at a time: each item every question the generator asked of one story
    (or worksheet), so a workload can keep a story's questions together."""
    if task not in TRAIN_GENERATORS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TRAIN_GENERATORS)}")
    k = 0
    while True:
        rng = random.Random(f"eval:{task}:{EVAL_SEED_BASE + seed}:{k}")
        drawn = TRAIN_GENERATORS[task](rng, sentences)
        if not drawn:
            raise ValueError(f"the {task} generator makes no example of {sentences} sentences")
        yield drawn
        k += 1
