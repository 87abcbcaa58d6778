"""ingot: a compact, fast LLM inference engine for PyTorch."""

from ingot.config import ConfigError, EngineConfig
from ingot.engine.request import RequestError
from ingot.engine.async_llm import AsyncLLM
from ingot.llm import LLM
from ingot.loading.errors import CheckpointError
from ingot.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ingot.sampling_params import SamplingError, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "Logprob",
    "RequestMetrics",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "ConfigError",
    "CheckpointError",
    "RequestError",
    "SamplingError",
]
__version__ = "0.1.0"
