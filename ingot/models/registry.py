"""HF architecture name -> ingot model class."""

from __future__ import annotations

from torch import nn

from ingot.config import ConfigError
from ingot.loading.errors import CheckpointError
from ingot.models.deepseek import DeepseekForCausalLM
from ingot.models.gemma import GemmaForCausalLM
from ingot.models.gpt_oss import GptOssForCausalLM
from ingot.models.llama import LlamaForCausalLM
from ingot.models.moe import MoEForCausalLM
from ingot.models.olmo2 import Olmo2ForCausalLM
from ingot.loading.model_config import ModelConfig

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": MoEForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[cfg.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise CheckpointError(f"unsupported architecture {cfg.architecture!r}; supported: {supported}") from None


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """ConfigError unless ``cfg``'s architecture supports tensor parallelism and its shapes
    split over ``size`` ranks. A model class supports it by taking ``tp`` in its constructor
    and naming its rules in ``tensor_parallel_error(cfg, size) -> Optional[str]``."""
    if size == 1:
        return
    rules = getattr(model_class(cfg), "tensor_parallel_error", None)
    if rules is None:
        raise ConfigError(f"{cfg.architecture} does not support tensor parallelism (tensor_parallel_size={size})",
                          "tensor_parallel_size")
    why = rules(cfg, size)
    if why is not None:
        raise ConfigError(f"{cfg.architecture} cannot be split over {size} ranks: {why}", "tensor_parallel_size")
