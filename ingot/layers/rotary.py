"""Rotary position embedding (neox style) with default, linear and Llama-3 scaling.

The cos/sin table is built once in fp32 exactly as HF transformers builds its
frequencies, so positions rotate identically to the HF model.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from ingot.loading.errors import CheckpointError
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.ops import reference


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (base**exps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 'llama3' rope scaling: stretch low frequencies, keep high ones."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, base: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    """The inverse frequencies for a model's rope settings (HF ``rope_scaling`` dict)."""
    inv_freq = _inv_freq(head_dim, base)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise CheckpointError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        pos = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if policy.is_native("rotary"):
            return reference.rotary_embedding(positions, q, k, self.cos_sin_cache)
        return torch.ops.ingot.rotary_embedding(positions, q, k, self.cos_sin_cache)
