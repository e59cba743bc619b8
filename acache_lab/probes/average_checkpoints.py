"""Probe: the average of checkpoints' weights (uniform, or weighted), written as a checkpoint of its own.

Averaging the weights of runs that start from one checkpoint (a "soup"), or of one run's last saved steps
(``save_every``), is a known way to keep what each learned while cancelling some of each run's noise.
docs/accuracy.md ("Averaging weights") measures both on the affix recipe's fifth stage.

    python -m acache_lab.probes.average_checkpoints --out build/affix-soup models/acache-tiny-affix build/affix-seed93
    python -m acache_lab.probes.average_checkpoints --out build/affix-tail build/affix/step-{1500..2000..100}
    python -m acache_lab.probes.average_checkpoints --out build/toward-plus --weights 0.85,0.15 \
        models/acache-tiny-affix models/acache-tiny-plus

The checkpoints must share the model's shape; the first one gives the config (its affix-training record included,
with ``averaged_from`` added) and the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from acache.models.checkpoint import save_checkpoint
from acache.models.config import AFFIX_TRAINING_KEY
from acache.models.loader import load_model

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def average_checkpoints(paths: Sequence[str | Path], out: str | Path,
                        weights: Sequence[float] | None = None) -> Path:
    """Writes to ``out`` the checkpoint whose every parameter is the mean of ``paths``' (summed in their order,
    then divided), or with ``weights`` (one a checkpoint, >= 0, summing to 1) their weighted sum, with the first
    one's config and tokenizer."""
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least two checkpoints, got {len(paths)}")
    if weights is not None:
        weights = [float(w) for w in weights]
        if len(weights) != len(paths):
            raise ValueError(f"{len(weights)} weights for {len(paths)} checkpoints: give one a checkpoint")
        if not all(math.isfinite(w) and w >= 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
            raise ValueError(f"the weights must be >= 0 and sum to 1, not {weights}")
    out = Path(out)
    for p in paths:
        if not (p / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"no checkpoint at {p} (no {CONFIG_FILE})")
        if p.resolve() == out.resolve():
            raise ValueError(f"--out {out} is one of the checkpoints averaged")
    model = load_model(paths[0])
    own = dict(model.named_parameters())
    scale = weights or [1.0] * len(paths)
    total = {name: scale[0] * t.detach() if weights else t.detach().clone() for name, t in own.items()}
    for p, w in zip(paths[1:], scale[1:], strict=True):
        other = dict(load_model(p).named_parameters())
        shapes = {n: tuple(t.shape) for n, t in own.items()}
        if {n: tuple(t.shape) for n, t in other.items()} != shapes:
            raise ValueError(f"{p} does not have the shape of {paths[0]}: only checkpoints of one model shape average")
        for name, t in other.items():
            total[name] += w * t.detach() if weights else t.detach()
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(total[name] if weights else total[name] / len(paths))
    save_checkpoint(model, out)
    config = json.loads((paths[0] / CONFIG_FILE).read_text())
    if isinstance(config.get(AFFIX_TRAINING_KEY), dict):
        config[AFFIX_TRAINING_KEY]["averaged_from"] = [str(p) for p in paths]
        if weights:
            config[AFFIX_TRAINING_KEY]["averaged_weights"] = weights
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (paths[0] / name).is_file():
            shutil.copy(paths[0] / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="checkpoint directories of one model shape")
    parser.add_argument("--out", required=True, help="where the averaged checkpoint is written")
    parser.add_argument("--weights", default=None,
                        help="comma-separated, one a checkpoint, summing to 1 (default: the uniform mean)")
    args = parser.parse_args()
    try:
        weights = [_number(w) for w in args.weights.split(",")] if args.weights else None
        print(average_checkpoints(args.checkpoints, args.out, weights))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--weights: {text.strip()!r} is not a number") from None


if __name__ == "__main__":
    main()
