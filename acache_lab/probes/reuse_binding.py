"""Probe: what direct reuse gets wrong on two-hop, sorted by whether the other object's answer was given instead.

A two-hop story has two objects, each picked up once ("apple went to mary"). Where both objects' answers are the
same (one holder, or two holders in one place) a model that knows the holders but not which object each took
cannot be wrong; where they differ it is right half the time. So a model that has lost the object-holder binding
scores ``same + differ / 2``, about 70% of the held-out stories, and every error it makes is the other object's
answer. ``holder`` asks the first hop alone ("apple went to ?"). docs/accuracy.md, "Why two-hop stays at 70%".

    python -m acache_lab.probes.reuse_binding --model models/acache-tiny-affix --sentences 6
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence

from acache.cli import _positive_int
from acache.policies import LAYOUTS
from acache_lab.probes.common import open_llm
from acache_lab.tasks.generators import Example, held_out

#: the outcomes, in the order printed
OUTCOMES = ("right, both answers equal", "right, answers differ", "the other object's answer", "something else")


def story_facts(story: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Who took each object, and where each person last went, read back from a two-hop story's words."""
    held_by: dict[str, str] = {}
    where: dict[str, str] = {}
    sentence: list[str] = []
    for word in story:
        if word != ".":
            sentence.append(word)
            continue
        if len(sentence) == 4 and sentence[1:3] == ["went", "to"]:
            held_by[sentence[0]] = sentence[3]
        elif len(sentence) == 5 and sentence[2:4] == ["to", "the"]:
            where[sentence[0]] = sentence[4]
        else:
            raise ValueError(f"not a two-hop sentence: {' '.join(sentence)!r}")
        sentence = []
    if sentence:
        raise ValueError(f"a story ends with a full stop, not {' '.join(sentence)!r}")
    return held_by, where


def outcome(example: Example, answer: Sequence[str]) -> str:
    """Which of :data:`OUTCOMES` a generated ``answer`` is, for a ``holder`` or ``twohop`` example."""
    if example.task not in ("holder", "twohop"):
        raise ValueError(f"the probe reads holder and twohop examples, not {example.task!r}")
    held_by, where = story_facts(example.affix)
    obj = example.question[0] if example.task == "holder" else example.question[3]
    others = [o for o in held_by if o != obj]
    if obj not in held_by or len(others) != 1:
        raise ValueError(f"a two-hop story takes two objects once each, not {sorted(held_by)}")

    if example.task == "twohop" and not set(held_by.values()) <= set(where):
        raise ValueError(f"a two-hop story places every holder, not {sorted(set(held_by.values()) - set(where))}")

    def answer_for(o: str) -> str:
        return held_by[o] if example.task == "holder" else where[held_by[o]]

    same = answer_for(others[0]) == answer_for(obj)
    if list(answer) == list(example.answer):
        return OUTCOMES[0] if same else OUTCOMES[1]
    return OUTCOMES[2] if list(answer) == [answer_for(others[0])] else OUTCOMES[3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/acache-tiny-affix")
    parser.add_argument("--sentences", type=_positive_int, default=6)
    parser.add_argument("--examples", type=_positive_int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--selector", default="none",
                        help="how the affix is served: none (direct reuse, the default), all (every affix token an "
                             "anchor) or a selector at --ratio")
    parser.add_argument("--ratio", type=float, default=0.2, help="the anchor ratio of a selector")
    args = parser.parse_args()
    from acache_lab.eval.tasks import task_params, task_prompts

    llm = open_llm(parser, args.model, attention=True)
    for task in ("holder", "twohop"):
        examples = held_out(task, args.examples, args.sentences, args.seed)
        for layout in LAYOUTS:
            params = task_params(task, selector=args.selector, anchor_ratio=args.ratio, seed=args.seed)
            outs = llm.generate(task_prompts(llm, examples, layout), params, use_tqdm=False)
            counts = Counter(outcome(e, o.text.split()) for e, o in zip(examples, outs, strict=True))
            print(f"{task} {layout}: " + ", ".join(f"{name} {counts[name]}" for name in OUTCOMES), flush=True)


if __name__ == "__main__":
    main()
