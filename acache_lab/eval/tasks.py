"""``acache eval tasks``: held-out exact match per task and layout, decoded with full recomputation."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from acache.affix.prompt import AffixPrompt
from acache.llm import LLM
from acache.policies import LAYOUTS
from acache.sampling_params import SamplingParams
from acache_lab.tasks.generators import TASKS, Example, held_out, parse_tasks
from acache_lab.tasks.render import answer_length, render_prompts


@dataclass
class TaskScore:
    task: str
    layout: str
    correct: int
    total: int
    gen_length: int | None = None  # the answer's room when it was not the task's region (``--gen-length``)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


#: the default block of a request with room (the server's default block_length)
ROOM_BLOCK = 32


def task_params(task: str, gen_length: int | None = None, **overrides) -> SamplingParams:
    """The study's decoding: the task's answer region as one block, threshold 0.9, dual cache. A
    ``block_length`` override must divide the answer region (blocks of 1 column for a 2-column answer, of 2 or 3
    for a 6-column one), so that far-mask pruning has blocks to prune.

    ``gen_length`` gives the answer more room than its region, as a server's ``max_tokens`` does: the model must
    then end the answer itself (EOS after it), which a region of the answer's own length never asks. It is
    decoded in blocks of ``min(gen_length, 32)`` unless ``block_length`` says otherwise."""
    n = answer_length(task)
    if gen_length is None:
        gen, block = n, overrides.pop("block_length", n) or n
        if n % block:
            block = n  # a task whose answer region the blocks do not divide decodes it as one block
    else:
        if gen_length < n:
            raise ValueError(f"gen_length {gen_length} is shorter than {task}'s answer region ({n} columns)")
        gen, block = gen_length, overrides.pop("block_length", None) or min(gen_length, ROOM_BLOCK)
        if gen % block:
            raise ValueError(f"gen_length {gen} is not a whole number of blocks of {block}")
    return SamplingParams(**{"gen_length": gen, "block_length": block, "threshold": 0.9, "cache": "dual",
                             **overrides})


def task_prompts(llm: LLM, examples: list[Example], layout: str) -> list[AffixPrompt]:
    """The examples rendered in ``layout`` with the model's tokenizer (the story marked as the affix)."""
    return render_prompts(llm.tokenizer, examples, layout)


def exact_matches(llm: LLM, prompts: list[AffixPrompt], examples: list[Example], params: SamplingParams) -> int:
    """How many generated answers equal the reference word for word (worked sums included), special tokens
    spelled out: an answer holding one is wrong (``o.text`` leaves them out, so '3 + <|startoftext|> 5 = 8' read as
    right; on 8,100 of the study's answers, direct reuse and ACache at 0.2, the two counts agree)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    spelled = (llm.tokenizer.decode(o.token_ids, skip_special_tokens=False) for o in outs)
    return sum(text.split() == list(e.answer) for text, e in zip(spelled, examples, strict=True))


def refuse_unread_suffix(llm: LLM, layouts: Sequence[str]) -> None:
    """A block-causal model cannot read text after its answer, so a suffix layout says nothing of it."""
    if "suffix" in layouts and getattr(llm.model, "block_causal", False):
        raise ValueError(f"a {llm.model.family} model is block-causal: it cannot read text after its answer, so "
                         "the suffix layout says nothing of it; use the prefix or infix layout")


def evaluate(llm: LLM, examples: int = 100, sentences: int = 6, seed: int = 0, tasks: tuple[str, ...] = TASKS,
             layouts: tuple[str, ...] = LAYOUTS, overrides: dict | None = None,
             gen_length: int | None = None, progress: bool = True) -> list[TaskScore]:
    """Exact match per task and layout; ``overrides`` change the decoding (``block_length``, FOCUS, far-mask),
    ``gen_length`` the answer's room (:func:`task_params`)."""
    refuse_unread_suffix(llm, layouts)
    scores = []
    bar = tqdm(total=len(tasks) * len(layouts) * examples, desc="eval tasks", unit="req", disable=not progress)
    for task in tasks:
        exs = held_out(task, examples, sentences, seed)
        for layout in layouts:
            bar.set_postfix(task=task, layout=layout)
            params = task_params(task, gen_length, **dict(overrides or {}))
            correct = exact_matches(llm, task_prompts(llm, exs, layout), exs, params)
            scores.append(TaskScore(task, layout, correct, len(exs), gen_length))
            bar.update(len(exs))
    bar.close()
    return scores


def story_sentences(example) -> int:
    """The sentences of an example's story (its context, else its affix): what ``--sentences`` asked for, where a
    generator keeps it (arithmetic caps its facts at 8, two-hop has at least 5 sentences, codes 6 pickups)."""
    return (example.context or example.affix).count(".")


def main(args) -> int:
    tasks = parse_tasks(getattr(args, "tasks", None))
    overrides = {k: getattr(args, k) for k in ("block_length", "threshold", "focus_layers", "focus_ratio",
                                               "far_mask_window")
                 if getattr(args, k, None) is not None}
    gen_length = getattr(args, "gen_length", None)
    blocks = {task: task_params(task, gen_length, **dict(overrides)).block_length  # checked before the model loads
              for task in tasks}
    layouts = tuple(x.strip() for x in args.layouts.split(",")) if getattr(args, "layouts", None) else LAYOUTS
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        raise ValueError(f"unknown layout {bad[0] if bad else args.layouts!r}; known: {', '.join(LAYOUTS)}")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_batch_size=args.batch_size)
    scores = evaluate(llm, args.examples, args.sentences, args.seed, tasks=tasks, layouts=layouts,
                      overrides=overrides, gen_length=gen_length)
    room = f", answers in {gen_length} columns (EOS after the answer)" if gen_length else ""
    asked = overrides.get("block_length")
    whole = [f"{task} in one block of {block}" for task, block in blocks.items() if asked and block != asked]
    if whole:  # a block that does not divide a task's answer region: that task decodes its region as one block
        room += f" ({', '.join(whole)}: its answer region is not a whole number of blocks of {asked})"
    drawn = {task: sorted({story_sentences(ex) for ex in held_out(task, args.examples, args.sentences, args.seed)})
             for task in tasks}
    other = [f"{task} {n[0]}" + (f"-{n[-1]}" if len(n) > 1 else "") for task, n in drawn.items()
             if n != [args.sentences]]
    length = f"contexts of {args.sentences} sentences" + (f" (as drawn: {', '.join(other)})" if other else "")
    print(f"held-out exact match, {args.examples} questions each, {length}, "
          "dual cache, full recomputation, threshold " + str(overrides.pop("threshold", 0.9))
          + "".join(f", {k} {v}" for k, v in overrides.items()) + room)
    print("| task | " + " | ".join(layouts) + " |")
    print("|---|" + "---:|" * len(layouts))
    for task in tasks:
        row = {s.layout: s for s in scores if s.task == task}
        print(f"| {task} | " + " | ".join(f"{100 * row[lay].accuracy:.1f}%" for lay in layouts) + " |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        records = [{k: v for k, v in s.__dict__.items() if v is not None} | {"accuracy": s.accuracy} for s in scores]
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0
