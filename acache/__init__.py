"""acache: an inference and serving engine for diffusion LLMs (LLaDA, Dream) with the ACache affix cache."""

from acache.affix.prompt import GEN, Affix, AffixPrompt
from acache.llm import LLM
from acache.outputs import RequestOutput, RequestStats
from acache.sampling_params import SamplingParams

__all__ = ["GEN", "LLM", "Affix", "AffixPrompt", "RequestOutput", "RequestStats", "SamplingParams"]
__version__ = "0.1.0"
