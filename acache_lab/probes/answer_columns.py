"""Where a model puts an answer given more columns than its region: the first decoding step's most likely token in
each column of an all-masked region, in context (full recomputation), over held-out requests.

A server reads an answer as the text up to the first stop token; a model that places its answer late in the region
(against the span that follows it, in the suffix layout) then returns nothing, though its words are there. This
counts, over ``requests``, the columns whose first-step token is not a stop token, and how many requests those
first-step tokens answer right read up to the first stop token and with every stop token dropped (docs/accuracy.md,
"Room beside the binding"). Past the first block (32 columns) the engine commits nothing at its first step; the
probe still reads what the model predicts there.

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
from acache.decoding.canvas import Layout, build_canvas
from acache.policies import LAYOUTS
from acache_lab.eval.tasks import refuse_unread_suffix, task_params, task_prompts
from acache_lab.tasks.generators import TASKS, held_out


@dataclass(frozen=True)
class Placement:
    """Over the requests: how often each column held a token other than a stop token at the first step, and how many
    first-step answers are right read up to the first stop token and with every stop token dropped."""

    requests: int
    word_columns: Counter
    right_to_first_eos: int
    right_without_eos: int


def readings(ids: list[int], stops: set[int], decode, answer: list[str]) -> tuple[bool, bool]:
    """Whether the token ``ids`` (one per column) answer ``answer`` word for word, as the task scores do, read up to
    the first of ``stops`` and with every one of them dropped."""
    first = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return (decode(ids[:first]).split() == answer,
            decode([t for t in ids if t not in stops]).split() == answer)


def placement(model: str, task: str, layout: str, gen_length: int, requests: int = 100,
              seed: int = 0) -> Placement:
    """The first step's most likely token in each of ``gen_length`` masked columns, for ``requests`` held-out
    requests of ``task`` in ``layout``: one in-context forward each over the prompt with its region masked."""
    params = task_params(task, gen_length)  # refuses a room shorter than the task's region, or not whole blocks
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    llm = LLM(model)
    if hasattr(llm.model, "train_logits"):
        raise ValueError(f"{model}: a {llm.model.family} model carries a state, not a forward over the whole canvas")
    refuse_unread_suffix(llm, (layout,))
    examples = held_out(task, requests, 6, seed)
    stops = llm.stop_token_ids
    columns: Counter = Counter()
    first = dropped = 0
    for prompt, example in zip(task_prompts(llm, examples, layout), examples, strict=True):
        canvas = build_canvas([Layout(prompt.token_ids, prompt.gen_at)], params.gen_length, llm.config.mask_token_id,
                              llm.config.pad_token_id, llm.model.device)
        with torch.no_grad():  # logits over the whole canvas: a shifted family reads column c from column c - 1
            hidden = llm.model(canvas.tokens, canvas.positions).hidden
            region = slice(canvas.gen_start, canvas.gen_start + canvas.gen_length)
            best = llm.model.logits(hidden, region)[0].argmax(-1).tolist()
        columns.update(i for i, t in enumerate(best) if t not in stops)
        to_stop, without = readings(best, stops, llm.tokenizer.decode, list(example.answer))
        first += to_stop
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
    try:
        task_params(args.task, args.gen_length)
    except ValueError as e:
        parser.error(str(e))
    for model in args.models:
        try:
            p = placement(model, args.task, args.layout, args.gen_length, args.requests, args.seed)
        except (FileNotFoundError, ValueError) as exc:  # not a checkpoint, or a family this probe cannot read
            parser.error(f"{model}: {exc}")
        where = ", ".join(f"column {c}: {n}" for c, n in sorted(p.word_columns.items()))
        print(f"{model} ({args.task}, {args.layout}, {args.gen_length} columns, {p.requests} requests): words in "
              f"{where or 'no column'}; right up to the first EOS {p.right_to_first_eos}, with every EOS dropped "
              f"{p.right_without_eos}")


if __name__ == "__main__":
    main()
