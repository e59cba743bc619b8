"""The paged serving engine: one shared copy of each affix, private anchors, continuous batching."""

from acache.engine.llm_engine import EngineConfig, EngineOutput, LLMEngine

__all__ = ["EngineConfig", "EngineOutput", "LLMEngine"]
