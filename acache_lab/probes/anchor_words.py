"""Probe: where in a two-hop story a selector's anchors land, word by word.

A two-hop answer needs the asked object's pickup sentence ("apple went to mary ."), whose holder's name the story
computed alone does not bind to the object (docs/accuracy.md, "Why two-hop stays at 70%"). This counts, over
held-out requests, the anchors on each word of the asked pickup sentence, of the other object's, on the moves and
on the story's header, and how many requests refresh the asked holder's name. docs/accuracy.md, "A tenth run".

    python -m acache_lab.probes.anchor_words --model build/affix-deep-v10 --selector attention --ratio 0.2
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence

from acache.policies import LAYOUTS, SELECTORS
from acache_lab.probes.common import open_llm
from acache_lab.tasks.generators import Example, held_out

#: the words of a pickup sentence, in order
PICKUP = ("object", "went", "to", "holder", ".")


def anchor_roles(example: Example, words: Sequence[str], anchors: Sequence[int]) -> Counter[str]:
    """What each anchor is: ``words`` are the affix's tokens as text (``story :`` then the story's words), and
    ``anchors`` indexes into them. A pickup anchor is named by its sentence (``asked``/``other``) and word
    (:data:`PICKUP`), a move sentence's as ``move``, the header's as ``header``."""
    if example.task != "twohop":
        raise ValueError(f"the probe reads twohop examples, not {example.task!r}")
    if list(words[:2]) != ["story", ":"] or list(words[2:]) != list(example.affix):
        raise ValueError("words must be the affix's: 'story :' then the example's story")
    asked = example.question[3]
    roles: Counter[str] = Counter()
    starts = [2] + [i + 1 for i in range(2, len(words)) if words[i] == "."]
    for a in anchors:
        if not 0 <= a < len(words):
            raise ValueError(f"anchor {a} is outside the affix's {len(words)} tokens")
        if a < 2:
            roles["header"] += 1
            continue
        start = max(s for s in starts if s <= a)
        sentence = words[start:start + 5]
        if list(sentence[1:3]) == ["went", "to"] and sentence[3] != "the":
            roles[f"{'asked' if sentence[0] == asked else 'other'} {PICKUP[a - start]}"] += 1
        else:
            roles["move"] += 1
    return roles


def affix_indices(positions: Sequence[int], gen_at: int, gen_length: int, start: int, length: int) -> list[int]:
    """Where each of a request's anchors (canvas ``positions``, as the engine reports them) sits in its affix of
    ``length`` tokens starting at prompt token ``start``: a prompt token at or past the generation region
    (``gen_at``, the suffix layout's affix) sits ``gen_length`` positions after its index."""
    out = []
    for p in positions:
        i = (p if p < gen_at else p - gen_length) - start
        if gen_at <= p < gen_at + gen_length or not 0 <= i < length:
            raise ValueError(f"anchor position {p} is not in the affix's {length} tokens at {start}")
        out.append(i)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/acache-tiny-affix")
    parser.add_argument("--selector", default="attention")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--sentences", type=int, default=6)
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    if bad := [layout for layout in layouts if layout not in LAYOUTS]:
        parser.error(f"unknown layout {bad[0]!r}; known: {', '.join(LAYOUTS)}")
    if args.examples < 1 or args.sentences < 1 or not 0.0 < args.ratio <= 1.0:
        parser.error("--examples and --sentences must be at least 1 and --ratio in (0, 1]")
    if args.selector not in SELECTORS or args.selector in ("none", "all"):
        parser.error(f"--selector must choose anchors: one of "
                     f"{', '.join(s for s in SELECTORS if s not in ('none', 'all'))}, not {args.selector!r}")
    from acache_lab.eval.tasks import task_params, task_prompts

    llm = open_llm(parser, args.model, attention=True)
    examples = held_out("twohop", args.examples, args.sentences, args.seed)
    params = task_params("twohop", selector=args.selector, anchor_ratio=args.ratio, seed=args.seed)
    for layout in layouts:
        prompts = task_prompts(llm, examples, layout)
        outs = llm.generate(prompts, params, use_tqdm=False)
        total: Counter[str] = Counter()
        named = 0
        for example, prompt, out in zip(examples, prompts, outs, strict=True):
            (span,) = prompt.affixes
            words = [llm.tokenizer.decode([t]).strip() for t in prompt.affix_ids(span)]
            index = affix_indices(out.stats.affix.anchors, prompt.gen_at, params.gen_length, span.start, len(words))
            roles = anchor_roles(example, words, index)
            named += roles["asked holder"] > 0
            total += roles
        print(f"{layout}: requests refreshing the asked holder {named} of {len(examples)}; anchors "
              + ", ".join(f"{role} {n}" for role, n in sorted(total.items(), key=lambda kv: -kv[1])), flush=True)


if __name__ == "__main__":
    main()
