"""acache: an inference and serving engine for diffusion LLMs (LLaDA, Dream) with the ACache affix cache."""

from acache.llm import LLM
from acache.outputs import RequestOutput, RequestStats
from acache.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "RequestStats", "SamplingParams"]
__version__ = "0.1.0"
