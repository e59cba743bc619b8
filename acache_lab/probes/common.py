"""What every probe does before it measures: open the model it is given, or end in its usage error naming what is
wrong (a path that is not a checkpoint, a family the probe cannot read) instead of a traceback from inside."""

from __future__ import annotations

import argparse

from acache import LLM
from acache.models.base import DiffusionLM
from acache.models.loader import load_model


def _refuse_state(parser: argparse.ArgumentParser, path: str, model: DiffusionLM) -> None:
    if getattr(model, "state_cache", False):
        parser.error(f"{path}: a {model.family} model carries a state instead of per-layer K/V over the whole "
                     "canvas, which this probe reads")


def open_llm(parser: argparse.ArgumentParser, path: str, attention: bool = False) -> LLM:
    """``LLM(path)``; ``attention``: the probe reads per-layer K/V or reuses affixes, which state-cache families
    (state-space, R2LM) do not have."""
    try:
        llm = LLM(path)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(f"{path}: {exc}")
    if attention:
        _refuse_state(parser, path, llm.model)
    return llm


def open_model(parser: argparse.ArgumentParser, path: str, attention: bool = False) -> DiffusionLM:
    """``load_model(path)``, refused as :func:`open_llm` refuses."""
    try:
        model = load_model(path)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(f"{path}: {exc}")
    if attention:
        _refuse_state(parser, path, model)
    return model
