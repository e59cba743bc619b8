"""What a model answers under direct reuse on the two-affix demonstrations: the holder's code, another holder's in
the story, the code of someone not in the story, or no code (docs/accuracy.md, "A nineteenth run").

    python -m acache_lab.probes.two_affix_answers MODEL [MODEL ...] [--requests 120] [--seed 0]
"""

from __future__ import annotations

import argparse
from collections import Counter

from acache import LLM
from acache.cli import _positive_int
from acache_lab.eval.tasks import task_params, task_prompts
from acache_lab.tasks.generators import held_out


def kinds(model: str, requests: int, seed: int) -> Counter:
    """Each answer's kind, counted over ``requests`` held-out two-affix requests decoded by direct reuse."""
    llm = LLM(model)
    exs = held_out("codes", requests, 6, seed)
    outs = llm.generate(task_prompts(llm, exs, "two-affix"), task_params("codes", selector="none", seed=seed),
                        use_tqdm=False)
    counts: Counter = Counter()
    for out, ex in zip(outs, exs, strict=True):
        code = dict(zip(ex.affix[0::4], ex.affix[2::4], strict=True))  # "NAME is CODE ." a demonstration
        holders = set(ex.context[3::5])  # "OBJECT went to NAME ." a pickup
        words = out.text.split()
        who = next((name for name, c in code.items() if words and c == words[0]), None)
        if words == list(ex.answer):
            counts["the holder's code"] += 1
        elif who is None:
            counts["no code"] += 1
        elif who == ex.bridge[0]:
            counts["the holder's code, then more words"] += 1
        else:
            counts["another holder's code" if who in holders else "the code of someone not in the story"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--requests", type=_positive_int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for model in args.models:
        try:
            counts = kinds(model, args.requests, args.seed)
        except (FileNotFoundError, ValueError) as exc:  # not a checkpoint, or a family without shared affixes
            parser.error(f"{model}: {exc}")
        print(model, ", ".join(f"{k} {v}" for k, v in counts.most_common()))


if __name__ == "__main__":
    main()
