"""The paged serving engine: one shared copy of each affix, private anchors, continuous batching.

request -> :class:`Scheduler` (admission, grouping, every state change) -> :class:`ModelRunner`
(batched selections and forwards through slot maps) -> :class:`EngineOutput`.
"""

from acache.engine.llm_engine import EngineConfig, LLMEngine
from acache.engine.outputs import EngineOutput
from acache.engine.request import Status

__all__ = ["EngineConfig", "EngineOutput", "LLMEngine", "Status"]
