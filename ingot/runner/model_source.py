"""ModelSource: how each tensor-parallel rank builds its shard of the model.

The driver hands one picklable source to every worker it spawns; each rank
then loads its own shard (only its part of every checkpoint tensor is read),
so no rank ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from torch import nn

from ingot.distributed.parallel import TensorParallel
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.model_config import ModelConfig
from ingot.models.loader import build_model, init_random, load_checkpoint


class ModelSource(Protocol):
    def load(self, tp: TensorParallel, device: torch.device, dtype: torch.dtype, max_position: int,
             progress: bool = False) -> nn.Module:
        """This rank's shard of the model, on ``device``; ``model.config`` is its ModelConfig."""
        ...


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint (HF directory, .gguf file, hub id; None: the default model)."""

    model: Optional[str]

    def load(self, tp: TensorParallel, device: torch.device, dtype: torch.dtype, max_position: int,
             progress: bool = False) -> nn.Module:
        ckpt = open_checkpoint(self.model)
        return load_checkpoint(ckpt, dtype, device, max_position, progress=progress, tp=tp)


@dataclass(frozen=True)
class RandomSource:
    """Seeded random weights of an HF config (benchmark shapes)."""

    hf_config: dict[str, Any] = field(hash=False)
    seed: int = 0

    def load(self, tp: TensorParallel, device: torch.device, dtype: torch.dtype, max_position: int,
             progress: bool = False) -> nn.Module:
        model = build_model(ModelConfig.from_hf(self.hf_config), dtype, device, max_position, tp)
        return init_random(model, self.seed)


def rank_config(model: nn.Module) -> ModelConfig:
    """The ModelConfig of one rank's shard: its own query and KV heads (what its KV pool holds)."""
    attn = model.attention_layers()[0]
    return dataclasses.replace(model.config, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads)
