"""Deepens a trained checkpoint without changing what it computes, so a run can ask whether depth is what bounds it.

After every ``every`` layers a new layer is inserted, a copy of the one before it whose two output projections
(``o_proj``, ``down_proj``) are zero: its attention and MLP then add nothing to the residual stream, so the deeper
model's logits equal the original's, and fine-tuning starts from the original's accuracy with the new layers free
to learn (LLaMA Pro's block expansion, arXiv 2401.02415):

    python -m acache_lab.train.expand --model models/acache-tiny-affix --out build/affix-deep-init
"""

from __future__ import annotations

import argparse
import copy
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from acache.models.base import DiffusionLM
from acache.models.checkpoint import derive_from, save_checkpoint
from acache.models.config import AFFIX_TRAINING_KEY
from acache.models.loader import load_model
from acache_lab.tracked import refuse_full_dir


def expand_layers(model: DiffusionLM, every: int = 1) -> DiffusionLM:
    """A copy of ``model`` with a silent layer after every ``every`` of its layers (module docstring)."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every must be a positive number of layers, got {every!r}")
    if not hasattr(model, "layers") or hasattr(model, "train_logits") or model.config.block_size is not None:
        raise ValueError(f"{model.family} cannot be deepened: only the bidirectional attention families "
                         "(llada, dream) are")
    if getattr(model, "_layers_compiled", False) or model.tp is not None:
        raise ValueError("deepen the model as loaded: a compiled layer's forward and a tensor-parallel shard would "
                         "be shared with the copies, not copied")
    layers = []
    for i, layer in enumerate(model.layers):
        layers.append(copy.deepcopy(layer))
        if (i + 1) % every == 0:
            silent = copy.deepcopy(layer)
            with torch.no_grad():
                silent.o_proj.weight.zero_()
                silent.down_proj.weight.zero_()
            layers.append(silent)
    deeper = copy.deepcopy(model, {id(model.layers): nn.ModuleList()})  # the rest; the layers are copied above
    deeper.layers = nn.ModuleList(layers)
    raw = {k: v for k, v in model.config.raw.items() if k != AFFIX_TRAINING_KEY}  # not trained deeper yet
    deeper.config = replace(model.config, num_layers=len(layers), raw=raw)
    return deeper


def expand_checkpoint(src: str | Path, out: str | Path, every: int = 1, overwrite: bool = False) -> Path:
    """Writes ``src`` deepened by :func:`expand_layers` to ``out``: its weights, its config.json with the layer
    count changed and the affix-training record dropped (the deeper model is a starting point, not a trained one),
    and its tokenizer and other companion files. ``overwrite`` replaces an ``out`` that holds files, all of them,
    once the deeper model is built."""
    src, out = Path(src), Path(out)
    if src.resolve().is_relative_to(out.resolve()):
        raise ValueError(f"the deeper checkpoint needs a directory of its own, not {out} (it holds {src})")
    refuse_full_dir(out, overwrite)
    deeper = expand_layers(load_model(src), every)
    if out.exists():
        shutil.rmtree(out)
    save_checkpoint(deeper, out)
    derive_from(src, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory to deepen")
    parser.add_argument("--out", required=True, help="where to write the deeper checkpoint")
    parser.add_argument("--every", type=int, default=1, help="a silent layer after every this many (default 1)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        out = expand_checkpoint(args.model, args.out, args.every, args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as e:
        parser.exit(2, f"error: {e}\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
