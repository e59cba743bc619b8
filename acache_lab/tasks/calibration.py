"""Calibration requests from the task suite, for profiling BiCache on the project's own models."""

from __future__ import annotations

from pathlib import Path

from acache.affix import calibration
from acache.affix.prompt import AffixPrompt
from acache.models.config import ModelConfig
from acache.models.tokenizer import Tokenizer
from acache.policies import LAYOUTS
from acache_lab.tasks.generators import TASKS, examples
from acache_lab.tasks.render import render_prompts

TASK_CALIBRATION = "tasks"


def task_calibration_prompts(tokenizer: Tokenizer, samples: int, seed: int = 0) -> list[AffixPrompt]:
    """``samples`` task requests, the tasks and layouts in turn, 6-sentence contexts, from
    ``acache_lab.tasks.generators.examples`` (its seed stream is neither training's nor the held-out one)."""
    if samples < 1:
        raise ValueError(f"samples must be positive, got {samples}")
    per_task = {t: examples(t, seed=10_000 + seed, count=samples) for t in TASKS}
    out = []
    for i in range(samples):
        ex = per_task[TASKS[i % len(TASKS)]][i]
        out += render_prompts(tokenizer, [ex], LAYOUTS[i % len(LAYOUTS)])
    return out


def calibration_prompts(tokenizer: Tokenizer, config: ModelConfig, path: str | Path | None, samples: int,
                        seed: int = 0) -> list[AffixPrompt]:
    """As :func:`acache.affix.calibration.calibration_prompts`; ``path="tasks"`` (and no such file) takes
    ``samples`` requests from the task suite's calibration stream, disjoint from the held-out one."""
    if path == TASK_CALIBRATION and not Path(path).exists():
        return task_calibration_prompts(tokenizer, samples, seed)
    return calibration.calibration_prompts(tokenizer, config, path, samples, seed)
