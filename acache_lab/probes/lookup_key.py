"""Probe: what does a trained model's story lookup key on — the name, or the first word of a sentence?

The diagnostic behind docs/model.md's runs 14-20. Takes held-out qa1 questions and asks them three ways,
changing only the words: as generated (each sentence starts with the person's name), with "the" before
every sentence (the name becomes the second word), and with every person replaced by an object
("apple went to the hallway", "where is milk ?"). A model whose lookup reads any key word in any place
answers all three alike.

    python -m acache_lab.probes.lookup_key --model models/acache-tiny
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from acache import LLM
from acache.cli import _positive_int
from acache.policies import LAYOUTS
from acache_lab.eval.tasks import exact_matches, task_params, task_prompts
from acache_lab.tasks.generators import NAMES, OBJECTS, Example, held_out


def with_article(example: Example) -> Example:
    """"the" before every sentence of the story, so its subject is the second word."""
    words: list[str] = ["the"]
    for i, word in enumerate(example.affix):
        words.append(word)
        if word == "." and i + 1 < len(example.affix):
            words.append("the")
    return replace(example, affix=tuple(words))


def with_objects(example: Example) -> Example:
    """Every person of the story and question replaced by a distinct object."""
    people = sorted({w for w in example.affix if w in NAMES})
    table = dict(zip(people, OBJECTS, strict=False))
    return replace(example, affix=tuple(table.get(w, w) for w in example.affix),
                   question=tuple(table.get(w, w) for w in example.question))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/acache-tiny")
    parser.add_argument("--questions", type=_positive_int, default=100)
    parser.add_argument("--layout", default="prefix", choices=LAYOUTS)
    args = parser.parse_args()
    try:
        llm = LLM(args.model)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    # stories with at most as many people as there are objects, so every person gets an object of their own
    pool = held_out("qa1", 4 * args.questions, 6)
    questions = [e for e in pool if len({w for w in e.affix if w in NAMES}) <= len(OBJECTS)][: args.questions]
    variants = {"as generated": questions,
                "'the' before every sentence": [with_article(e) for e in questions],
                "objects in place of people": [with_objects(e) for e in questions]}
    for name, variant in variants.items():
        right = exact_matches(llm, task_prompts(llm, variant, args.layout), variant, task_params("qa1"))
        print(f"{name:>30}: {right}/{len(variant)}   e.g. {' '.join(variant[0].affix[:10])} ... | "
              f"{' '.join(variant[0].question)}")


if __name__ == "__main__":
    main()
