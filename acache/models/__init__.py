"""Model families, their upstream checkpoint format, and the tokenizer."""

from acache.models.base import DiffusionLM, ForwardOutput
from acache.models.config import ConfigError, ModelConfig
from acache.models.dream import DreamModel
from acache.models.fast_dllm_v2 import FastDLLMv2Model
from acache.models.kv import KVCache
from acache.models.llada import LLaDAModel
from acache.models.loader import CheckpointError, load_model, read_config
from acache.models.registry import family_class, resolve_model_class
from acache.models.tokenizer import Tokenizer

__all__ = [
    "CheckpointError", "ConfigError", "DiffusionLM", "DreamModel", "FastDLLMv2Model", "ForwardOutput", "KVCache",
    "LLaDAModel",
    "ModelConfig", "Tokenizer", "family_class", "load_model", "read_config", "resolve_model_class",
]
