"""ingot: a compact, fast LLM inference engine for PyTorch."""

from ingot.config import ConfigError, EngineConfig
from ingot.engine.engine import RequestError
from ingot.llm import LLM
from ingot.loading.errors import CheckpointError
from ingot.outputs import CompletionOutput, RequestOutput
from ingot.sampling_params import SamplingError, SamplingParams

__all__ = [
    "LLM",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "ConfigError",
    "CheckpointError",
    "RequestError",
    "SamplingError",
]
__version__ = "0.1.0"
