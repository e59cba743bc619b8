"""Probe: does a qa1 model look the asked person up, or answer with the story's last place?

The diagnostic behind docs/model.md's state-space section. On held-out qa1 questions, each answer is
sorted: right; the last place the story mentions (whoever went there); and a place the asked person went to
at some point. A model that answers the last place whatever the question scores about what that shortcut
scores (the share of questions whose person moved last), and its answers are rarely the asked person's
earlier places.

    python -m acache_lab.probes.recency --model models/acache-tiny
"""

from __future__ import annotations

import argparse

from acache import LLM
from acache.cli import _positive_int
from acache.policies import LAYOUTS
from acache_lab.eval.tasks import task_params, task_prompts
from acache_lab.tasks.generators import NAMES, PLACES, Example, held_out


def places_of(example: Example) -> tuple[list[str], list[str]]:
    """Every place the story mentions, in order, and those the asked person went to."""
    story = list(example.affix)
    who = next(w for w in example.question if w in NAMES)
    sentences = " ".join(story).split(" . ")
    mentioned = [w for w in story if w in PLACES]
    theirs = [w for s in sentences for w in s.split() if w in PLACES and s.split()[0] == who]
    return mentioned, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/acache-tiny")
    ap.add_argument("--questions", type=_positive_int, default=200)
    ap.add_argument("--layouts", default="prefix,infix")
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    if bad := [x for x in layouts if x not in LAYOUTS]:
        ap.error(f"unknown layout {bad[0]!r}; known: {', '.join(LAYOUTS)}")
    try:
        llm = LLM(args.model)
    except (FileNotFoundError, ValueError) as err:
        ap.error(str(err))
    exs = held_out("qa1", args.questions, 6)
    shortcut = sum(places_of(e)[0][-1:] == list(e.answer) for e in exs)
    print(f"{args.model}: {len(exs)} held-out qa1 questions; the story's last place is the answer in {shortcut}")
    for layout in layouts:
        outs = llm.generate(task_prompts(llm, exs, layout), task_params("qa1"), use_tqdm=False)
        right = last = theirs = 0
        for out, example in zip(outs, exs, strict=True):
            answer = out.text.split()[:1]
            mentioned, visited = places_of(example)
            right += answer == list(example.answer)
            last += answer == mentioned[-1:]
            theirs += bool(answer) and answer[0] in visited
        print(f"  {layout:>6}: right {right}, the story's last place {last}, one of the asked person's places "
              f"{theirs}")


if __name__ == "__main__":
    main()
