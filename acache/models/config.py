"""The one internal model configuration, read from an upstream ``config.json``.

Each family (LLaDA, Dream) knows its own upstream field names and turns them into a
:class:`ModelConfig`; nothing downstream reads the raw JSON again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A ``config.json`` that is missing a field or holds a value the engine cannot run."""


#: the config.json entry affix-aware training writes (acache_lab.train): its settings, so that a server can
#: serve such a model's affixes by direct reuse by default
AFFIX_TRAINING_KEY = "acache_affix_training"


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    head_size: int | None = None  # set where heads are not hidden_size / num_heads (a tensor-parallel shard)
    #: block-causal attention (block diffusion): a token sees every earlier block of this many positions and its
    #: own block, both ways; None is full bidirectional attention (LLaDA, Dream)
    block_size: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def affix_training(self) -> dict | None:
        return affix_training(self)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.family} config: {name} must be positive, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError(f"{self.family} config: the block size must be positive, got {self.block_size}")
        if self.head_size is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"{self.family} config: hidden size {self.hidden_size} is not divisible by "
                f"{self.num_heads} attention heads")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.family} config: {self.num_heads} query heads are not a multiple of "
                f"{self.num_kv_heads} key/value heads")
        if self.head_dim % 2:
            raise ConfigError(f"{self.family} config: the head dimension {self.head_dim} is odd; rotary position "
                              "embeddings rotate pairs of dimensions")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{self.family} config: {name} must be a positive number, got {value}")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"{self.family} config: {name}={value} is outside the vocabulary "
                                  f"of {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden_size // self.num_heads


def require(raw: dict[str, Any], key: str, family: str) -> Any:
    """Reads a mandatory field, naming it when it is absent."""
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{family} config.json is missing the field '{key}'")
    return raw[key]


_REQUIRED = object()


def integer(raw: dict[str, Any], key: str, family: str, default: Any = _REQUIRED) -> int | None:
    """An integer field (mandatory without ``default``; null reads as absent, and a ``default`` of None gives
    None), naming the field when its value is not a whole number: ``"abc"`` or ``1.7`` layers are refused, never
    truncated."""
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            require(raw, key, family)  # raises, naming the field
        if default is None:
            return None
        value = default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{family} config.json: '{key}' must be a whole number, got {value!r}")
    return value


def number(raw: dict[str, Any], key: str, family: str, default: float) -> float:
    """A real-valued field with a default (null reads as absent), naming the field when its value is not a number."""
    value = raw.get(key)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{family} config.json: '{key}' must be a number, got {value!r}")
    return float(value)


def boolean(raw: dict[str, Any], key: str, family: str, default: bool) -> bool:
    """A true/false field with a default (null reads as absent), naming the field when its value is not a JSON
    boolean: ``"false"`` is refused, never read as true."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{family} config.json: '{key}' must be true or false, got {value!r}")
    return value


def affix_training(config: object) -> dict | None:
    """The record affix-aware training left in a model's config.json (its affixes were trained to be reused as
    computed alone), or None; for any family's config (the state-cache families' have a ``raw`` of their own)."""
    record = (getattr(config, "raw", None) or {}).get(AFFIX_TRAINING_KEY)
    return record if isinstance(record, dict) else None
