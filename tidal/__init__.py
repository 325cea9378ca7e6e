"""tidal: LLM inference and serving with load-adaptive speculative decoding."""

from tidal.config import EngineConfig, SamplingParams, SpecConfig
from tidal.llm import LLM, LLMEngine
from tidal.request import CompletionOutput, RequestOutput
from tidal.version import __version__

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "SpecConfig", "RequestOutput", "CompletionOutput",
           "__version__"]
