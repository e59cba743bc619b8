"""Where a model puts an answer given more columns than its region: the first decoding step's most likely token in
each column of an all-masked region, in context (full recomputation), over held-out requests.

A server reads an answer as the text up to the first EOS; a model that places its answer late in the region (against
the span that follows it, in the suffix layout) then returns nothing, though its words are there. This counts, over
``requests``, the columns that hold a word at the first step, and how many requests those first-step words answer
right when read up to the first EOS and with every EOS dropped (docs/accuracy.md, "Room beside the binding").

    python -m acache_lab.probes.answer_columns MODEL [MODEL ...] --task qa1 --layout suffix --gen-length 8 \\
        [--requests 100] [--seed 0]
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass

import torch

from acache import LLM
from acache.cli import _positive_int
from acache.policies import LAYOUTS
from acache_lab.eval.tasks import task_params, task_prompts
from acache_lab.tasks.generators import TASKS, held_out


@dataclass(frozen=True)
class Placement:
    """Over the requests: how often each column held a word at the first step, and how many first-step answers are
    right read up to the first EOS and with every EOS dropped."""

    requests: int
    word_columns: Counter
    right_to_first_eos: int
    right_without_eos: int


def readings(tokens: list[str | None], answer: list[str]) -> tuple[bool, bool]:
    """Whether ``tokens`` (one per column, None for EOS) answer ``answer`` read up to the first EOS, and with every
    EOS dropped."""
    cut = tokens[:tokens.index(None)] if None in tokens else tokens
    return cut == answer, [t for t in tokens if t is not None] == answer


def placement(model: str, task: str, layout: str, gen_length: int, requests: int = 100,
              seed: int = 0) -> Placement:
    """The first step's most likely token in each of ``gen_length`` masked columns, for ``requests`` held-out
    requests of ``task`` in ``layout``, each decoded alone in context."""
    params = task_params(task, gen_length)  # refuses a room shorter than the task's region, or not whole blocks
    llm = LLM(model)
    examples = held_out(task, requests, 6, seed)
    mask, eos = llm.config.mask_token_id, llm.config.eos_token_id
    columns: Counter = Counter()
    first = dropped = 0
    for prompt, example in zip(task_prompts(llm, examples, layout), examples, strict=True):
        ids = [*prompt.token_ids[:prompt.gen_at], *[mask] * params.gen_length, *prompt.token_ids[prompt.gen_at:]]
        x = torch.tensor([ids], device=llm.model.device)
        with torch.no_grad():
            hidden = llm.model(x, torch.arange(len(ids), device=x.device)[None]).hidden
            best = llm.model.logits(hidden[:, prompt.gen_at:prompt.gen_at + params.gen_length])[0].argmax(-1)
        tokens = [None if int(t) == eos else llm.tokenizer.decode([int(t)]) for t in best]
        columns.update(i for i, t in enumerate(tokens) if t is not None)
        to_eos, without = readings(tokens, list(example.answer))
        first += to_eos
        dropped += without
    return Placement(requests, columns, first, dropped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--task", choices=TASKS, default="qa1")
    parser.add_argument("--layout", choices=LAYOUTS, default="suffix")
    parser.add_argument("--gen-length", type=_positive_int, default=8)
    parser.add_argument("--requests", type=_positive_int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for model in args.models:
        p = placement(model, args.task, args.layout, args.gen_length, args.requests, args.seed)
        where = ", ".join(f"column {c}: {n}" for c, n in sorted(p.word_columns.items()))
        print(f"{model} ({args.task}, {args.layout}, {args.gen_length} columns, {p.requests} requests): words in "
              f"{where or 'no column'}; right up to the first EOS {p.right_to_first_eos}, with every EOS dropped "
              f"{p.right_without_eos}")


if __name__ == "__main__":
    main()
