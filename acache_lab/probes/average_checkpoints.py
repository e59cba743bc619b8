"""Probe: the average of checkpoints' weights (uniform, or weighted), written as a checkpoint of its own.

Averaging the weights of runs that start from one checkpoint (a "soup"), or of one run's last saved steps
(``save_every``), is a known way to keep what each learned while cancelling some of each run's noise.
docs/accuracy.md ("Averaging weights") measures both on the affix recipe's fifth stage.

    python -m acache_lab.probes.average_checkpoints --out build/affix-soup build/affix-bridge-mix-2 build/affix-seed93
    python -m acache_lab.probes.average_checkpoints --out build/affix-tail build/affix/step-{1500..2000..100}
    python -m acache_lab.probes.average_checkpoints --out build/toward-plus --weights 0.85,0.15 \
        build/affix-bridge-mix-2 models/acache-tiny-plus

The checkpoints must be one model (the same config and tokenizer); the first one gives the config, its affix-training
record included, and the sources are recorded under ``acache_averaged`` in config.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import torch

from acache.models.checkpoint import save_checkpoint
from acache.models.config import affix_training
from acache.models.loader import load_model
from acache_lab.tracked import refuse_full_dir, refuse_tracked

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def average_checkpoints(paths: Sequence[str | Path], out: str | Path, weights: Sequence[float] | None = None,
                        overwrite: bool = False) -> Path:
    """Writes to ``out`` the checkpoint whose every parameter is the mean of ``paths``' (summed in their order,
    then divided), or with ``weights`` (one per checkpoint, >= 0, summing to 1) their weighted sum, in the first
    one's dtype, with its config (its affix-training record included) and tokenizer, and the sources recorded
    under ``acache_averaged``. The checkpoints must be one model: the same config and tokenizer. ``overwrite``
    replaces an ``out`` that holds files, all of them."""
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least two checkpoints, got {len(paths)}")
    if weights is not None:
        weights = [float(w) for w in weights]
        if len(weights) != len(paths):
            raise ValueError(f"{len(weights)} weights for {len(paths)} checkpoints: give one per checkpoint")
        if not all(math.isfinite(w) and w >= 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
            raise ValueError(f"the weights must be >= 0 and sum to 1, not {weights}")
    out = Path(out)
    for p in paths:
        if not (p / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"no checkpoint at {p} (no {CONFIG_FILE})")
        if out.resolve() == p.resolve() or out.resolve() in p.resolve().parents:
            raise ValueError(f"--out {out} holds {p}, one of the checkpoints averaged: write elsewhere")
    refuse_full_dir(out, overwrite)
    model = load_model(paths[0])
    tokenizer = _tokenizer_bytes(paths[0])
    own = dict(model.named_parameters())
    scale = weights or [1.0] * len(paths)  # the uniform mean sums first and divides last (x 1.0 is exact)
    total = {name: scale[0] * t.detach() for name, t in own.items()}
    records = [affix_training(model.config) is not None]
    for p, w in zip(paths[1:], scale[1:], strict=True):
        member = load_model(p)
        differs = _first_difference(model.config, member.config)  # equal configs: equal shapes too
        if differs:
            raise ValueError(f"{p} is not the model of {paths[0]} ({differs}): only checkpoints of one model average")
        if _tokenizer_bytes(p) != tokenizer:
            raise ValueError(f"{p} has another tokenizer than {paths[0]}: only checkpoints of one model average")
        records.append(affix_training(member.config) is not None)
        for name, t in member.named_parameters():
            total[name] += w * t.detach()
    if len(set(records)) > 1:
        warnings.warn(f"only some of the checkpoints carry an affix-training record ({sum(records)} of "
                      f"{len(records)}): the average keeps the first one's ({'one' if records[0] else 'none'})",
                      stacklevel=2)
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(total[name] if weights else total[name] / len(paths))
    config = json.loads((paths[0] / CONFIG_FILE).read_text())
    config["acache_averaged"] = {"from": [str(p) for p in paths], "weights": weights}
    if out.exists():
        shutil.rmtree(out)
    save_checkpoint(model, out, dtype=config.get("torch_dtype"))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (paths[0] / name).is_file():
            shutil.copy(paths[0] / name, out / name)
    return out


def _first_difference(a: object, b: object) -> str | None:
    """The first field (the config.json ``raw`` aside) where two models' configs differ, as ``name a != b``; any
    family's config (the state-cache families have configs of their own)."""
    if type(a) is not type(b):
        return f"config {type(a).__name__} != {type(b).__name__}"
    for f in fields(type(a)):
        if f.compare and getattr(a, f.name) != getattr(b, f.name):
            return f"{f.name} {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
    return None


def _tokenizer_bytes(path: Path) -> bytes | None:
    file = path / TOKENIZER_FILES[0]
    return file.read_bytes() if file.is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="checkpoint directories of one model")
    parser.add_argument("--out", required=True, help="where the averaged checkpoint is written")
    parser.add_argument("--weights", default=None,
                        help="comma-separated, one per checkpoint, summing to 1 (default: the uniform mean)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out, and write over files git tracks")
    args = parser.parse_args()
    try:
        refuse_tracked([args.out], args.overwrite)
        weights = [_number(w) for w in args.weights.split(",")] if args.weights is not None else None
        print(average_checkpoints(args.checkpoints, args.out, weights, args.overwrite))
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--weights: {text.strip()!r} is not a number") from None


if __name__ == "__main__":
    main()
