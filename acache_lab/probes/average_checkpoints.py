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
import shutil
from collections.abc import Sequence
from pathlib import Path

from acache.models.checkpoint import save_checkpoint
from acache_lab.tracked import refuse_full_dir, refuse_tracked
from acache_lab.train.average import CONFIG_FILE, TOKENIZER_FILES, average_models


def average_checkpoints(paths: Sequence[str | Path], out: str | Path, weights: Sequence[float] | None = None,
                        overwrite: bool = False) -> Path:
    """Writes to ``out`` the checkpoint :func:`~acache_lab.train.average.average_models` makes of ``paths`` (the
    uniform mean, or the ``weights``' sum), in the first one's dtype, with its config (its affix-training record
    included) and tokenizer, and the sources recorded under ``acache_averaged``. ``overwrite`` replaces an ``out``
    that holds files, all of them."""
    paths = [Path(p) for p in paths]
    out = Path(out)
    for p in paths:
        if p.resolve().is_relative_to(out.resolve()):
            raise ValueError(f"--out {out} holds {p}, one of the checkpoints averaged: write elsewhere")
    refuse_full_dir(out, overwrite)
    model = average_models(paths, weights)
    config = json.loads((paths[0] / CONFIG_FILE).read_text())
    config["acache_averaged"] = {"from": [str(p) for p in paths],
                                 "weights": None if weights is None else [float(w) for w in weights]}
    if out.exists():
        shutil.rmtree(out)
    save_checkpoint(model, out, dtype=config.get("torch_dtype"))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (paths[0] / name).is_file():
            shutil.copy(paths[0] / name, out / name)
    return out


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
