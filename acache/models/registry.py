"""Maps a checkpoint's ``model_type`` / ``architectures`` to the model class that runs it."""

from __future__ import annotations

from typing import Any

from acache.models.base import DiffusionLM
from acache.models.config import ConfigError
from acache.models.dream import DreamModel
from acache.models.fast_dllm_v2 import FastDLLMv2Model
from acache.models.llada import LLaDAModel
from acache.models.r2lm import R2LM
from acache.models.ssm import SSMBlockDiffusionLM

#: the families the engine serves
MODEL_CLASSES: tuple[type[DiffusionLM], ...] = (LLaDAModel, DreamModel, FastDLLMv2Model)
#: the families with a cache of their own, decoded block by block (``engine/state_runner.py``)
STATE_CACHE_CLASSES: tuple[type, ...] = (SSMBlockDiffusionLM, R2LM)
ALL_CLASSES = MODEL_CLASSES + STATE_CACHE_CLASSES


def family_class(name: str) -> type:
    """The class of a family name such as ``llada`` or ``dream``."""
    for cls in ALL_CLASSES:
        if cls.family == name.lower():
            return cls
    raise ValueError(f"unknown model family {name!r}; known: {', '.join(c.family for c in ALL_CLASSES)}")


def resolve_model_class(raw: dict[str, Any], source: str = "config.json") -> type:
    """Picks the class from ``model_type`` first, then ``architectures``; names the type when unknown."""
    model_type = str(raw.get("model_type", "")).lower()
    archs = raw.get("architectures") or []
    for cls in ALL_CLASSES:
        if model_type in cls.model_types:
            return cls
    for cls in ALL_CLASSES:
        if any(a in cls.architectures for a in archs):
            return cls
    known = ", ".join(t for c in ALL_CLASSES for t in c.model_types)
    raise ConfigError(f"{source}: unknown model type {raw.get('model_type')!r} "
                      f"(architectures {archs}); supported model types: {known}")
