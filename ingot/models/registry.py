"""HF architecture name -> ingot model class."""

from __future__ import annotations

from torch import nn

from ingot.loading.errors import CheckpointError
from ingot.models.llama import LlamaForCausalLM
from ingot.models.moe import MoEForCausalLM
from ingot.loading.model_config import ModelConfig

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": MoEForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[cfg.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise CheckpointError(f"unsupported architecture {cfg.architecture!r}; supported: {supported}") from None
