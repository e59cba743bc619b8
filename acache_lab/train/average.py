"""The mean of checkpoints of one model: what a soup recipe starts from.

Averaging the weights of runs that start from one checkpoint (a "soup"), or of one run's last saved steps
(``save_every``), keeps what each learned while cancelling some of each run's noise (docs/accuracy.md,
"Averaging weights"). The trainer's ``init_from`` takes a list of checkpoints and starts from their mean, and
``python -m acache_lab.probes.average_checkpoints`` writes the mean as a checkpoint of its own; both call
:func:`average_models`, so for float32 checkpoints (all the trainer writes) a run started from the list equals, byte
for byte, one started from the written mean (the probe writes in the first checkpoint's dtype, which rounds a
bfloat16 mean).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import torch

from acache.models.base import DiffusionLM
from acache.models.config import affix_training
from acache.models.loader import CONFIG_FILE, load_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def average_models(paths: Sequence[str | Path], weights: Sequence[float] | None = None,
                   warn_records: bool = True) -> DiffusionLM:
    """The first checkpoint's model (as :func:`load_model` loads it, float32) with every parameter replaced by the
    mean of ``paths``' (summed in their order, then divided), or with ``weights`` (one per checkpoint, >= 0, summing
    to 1) their weighted sum. The checkpoints must be one model: the same config and tokenizer. ``warn_records``
    warns when only some carry an affix-training record (a written average keeps the first one's)."""
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least two checkpoints, got {len(paths)}")
    if weights is not None:
        weights = [float(w) for w in weights]
        if len(weights) != len(paths):
            raise ValueError(f"{len(weights)} weights for {len(paths)} checkpoints: give one per checkpoint")
        if not all(math.isfinite(w) and w >= 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
            raise ValueError(f"the weights must be >= 0 and sum to 1, not {weights}")
    for p in paths:
        if not (p / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"no checkpoint at {p} (no {CONFIG_FILE})")
    model = load_model(paths[0])
    tokenizer = tokenizer_bytes(paths[0])
    own = dict(model.named_parameters())
    scale = weights or [1.0] * len(paths)  # the uniform mean sums first and divides last (x 1.0 is exact)
    total = {name: scale[0] * t.detach() for name, t in own.items()}
    records = [affix_training(model.config) is not None]
    for p, w in zip(paths[1:], scale[1:], strict=True):
        member = load_model(p)
        differs = first_difference(model.config, member.config)  # equal configs: equal shapes too
        if differs:
            raise ValueError(f"{p} is not the model of {paths[0]} ({differs}): only checkpoints of one model average")
        if tokenizer_bytes(p) != tokenizer:
            raise ValueError(f"{p} has another tokenizer than {paths[0]}: only checkpoints of one model average")
        records.append(affix_training(member.config) is not None)
        for name, t in member.named_parameters():
            total[name] += w * t.detach()
    if warn_records and len(set(records)) > 1:
        warnings.warn(f"only some of the checkpoints carry an affix-training record ({sum(records)} of "
                      f"{len(records)}): the average keeps the first one's ({'one' if records[0] else 'none'})",
                      stacklevel=3)
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(total[name] if weights else total[name] / len(paths))
    return model


def first_difference(a: object, b: object) -> str | None:
    """The first field (the config.json ``raw`` aside) where two models' configs differ, as ``name a != b``; any
    family's config (the state-cache families have configs of their own)."""
    if type(a) is not type(b):
        return f"config {type(a).__name__} != {type(b).__name__}"
    for f in fields(type(a)):
        if f.compare and getattr(a, f.name) != getattr(b, f.name):
            return f"{f.name} {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
    return None


def tokenizer_bytes(path: Path) -> bytes | None:
    file = path / TOKENIZER_FILES[0]
    return file.read_bytes() if file.is_file() else None
