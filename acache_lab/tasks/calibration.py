"""Calibration requests for BiCache profiling: the task suite's, a JSONL file's, or random tokens'."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from acache.affix.prompt import Affix, AffixPrompt, layout_segments, resolve_segments
from acache.models.config import ModelConfig
from acache.models.tokenizer import Tokenizer
from acache.policies import LAYOUTS
from acache_lab.tasks.generators import TASKS, examples
from acache_lab.tasks.render import render_prompts

TASK_CALIBRATION = "tasks"


def task_calibration_prompts(tokenizer: Tokenizer, samples: int, seed: int = 0) -> list[AffixPrompt]:
    """``samples`` task requests, 6-sentence contexts, from ``acache_lab.tasks.generators.examples`` (its seed
    stream is neither training's nor the held-out one): the tasks in turn, each task's layouts in turn, so that
    every task meets every layout (both turned together with ``i``, which paired each task with one layout)."""
    if samples < 1:
        raise ValueError(f"samples must be positive, got {samples}")
    per_task = {t: examples(t, seed=10_000 + seed, count=samples) for t in TASKS}
    out = []
    for i in range(samples):
        turn = i // len(TASKS)
        ex = per_task[TASKS[i % len(TASKS)]][turn]
        out += render_prompts(tokenizer, [ex], LAYOUTS[turn % len(LAYOUTS)])
    return out


def calibration_prompts(tokenizer: Tokenizer, config: ModelConfig, path: str | Path | None, samples: int,
                        seed: int = 0) -> list[AffixPrompt]:
    """Requests to profile BiCache on. ``path="tasks"`` (and no such file) takes ``samples`` requests from the
    task suite's calibration stream, disjoint from the held-out one; a JSONL file holds one
    ``{"affix": str, "prompt": str, "layout": "prefix"|"infix"|"suffix", "answer_prompt": str}`` a line;
    no path gives ``samples`` random-token requests with affixes of varied share."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    if path == TASK_CALIBRATION and not Path(path).exists():
        return task_calibration_prompts(tokenizer, samples, seed)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"calibration file not found: {path}")
        prompts = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                if not isinstance(item, dict):
                    raise TypeError(f"a JSON {type(item).__name__}, not an object of fields")
                segs = layout_segments(item.get("layout", "prefix"), Affix(item["affix"]), item["prompt"],
                                       item.get("answer_prompt", ""))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a calibration record ({exc})") from None
            prompts.append(resolve_segments(segs, encode))
        if not prompts:
            raise ValueError(f"{path} holds no calibration records")
        return prompts
    gen = torch.Generator().manual_seed(seed)
    specials = {config.mask_token_id, config.eos_token_id, config.pad_token_id}
    vocab = min(config.vocab_size, tokenizer.vocab_size)

    def tokens(n: int) -> list[int]:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        return [t if t not in specials else 0 for t in ids]

    prompts = []
    for i in range(samples):
        affix_len = int(torch.randint(8, 160, (1,), generator=gen))
        question_len = int(torch.randint(4, 96, (1,), generator=gen))
        segs = layout_segments(LAYOUTS[i % 3], Affix(token_ids=tokens(affix_len)), tokens(question_len))
        prompts.append(resolve_segments(segs, encode))
    return prompts
