"""Rotary position embedding (neox style) with default, linear, Llama-3, LongRoPE and YaRN scaling.

The cos/sin table is built once in fp32 exactly as HF transformers builds its
frequencies, so positions rotate identically to the HF model.

Partial rotary (Phi-3/4: the first ``rotary_dim`` dims of a head rotate, pairs
``(i, i + rotary_dim / 2)``, the rest pass) runs on the full-head kernels: the
q/k projection rows of each head are reordered at load (``partial_rotary_order``)
so that HF's rotated pairs become the neox pairs ``(i, i + head_dim / 2)`` of the
first columns, and the table's remaining columns are the identity (cos 1, sin 0).
q.k is unchanged by a permutation shared by q and k, and v is not reordered.

LongRoPE (Phi-3 ``su`` / ``longrope``) has two sets of frequency divisors. HF
picks one per forward by the sequence's length (long once it exceeds
``original_max_position_embeddings``, recomputing the cache at the crossing);
ingot picks once per engine, by the context it serves: the long factors when
``max_model_len`` exceeds ``original_max_position_embeddings``, else the short
ones. Sequences then agree with HF when the engine's context fits the original
one, and when it does not, for sequences whose prompt already exceeds it; a
short sequence on a long-context engine rotates with the long factors. Both
sets scale cos and sin by the same attention factor.

YaRN (``rope_type: yarn``: gpt-oss, DeepSeek-V2 / V3, Qwen) blends interpolated and
extrapolated frequencies over a ramp between the ``beta_fast`` / ``beta_slow`` correction
dims and scales cos and sin by its attention factor, as HF's ``_compute_yarn_parameters``
(``truncate`` rounds the ramp's ends to whole dims, HF's default); DeepSeek's softmax scale
takes ``yarn_mscale(factor, mscale_all_dim)`` squared on top (``yarn_softmax_scale``).
DeepSeek's interleaved pairs ``(x0, x1), (x2, x3)...`` become neox pairs by a reordering of
q/k rows at load (``interleaved_rope_order``).
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


def _longrope(head_dim: int, base: float, scaling: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE: (inverse frequencies, attention factor); the long factors when ``max_position``
    exceeds ``original_max_position_embeddings`` (``model_config`` fills it and ``factor`` in)."""
    original = int(scaling["original_max_position_embeddings"])
    key = "long_factor" if max_position > original else "short_factor"
    factors = scaling.get(key)
    if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2:
        count = len(factors) if isinstance(factors, (list, tuple)) else factors
        raise CheckpointError(f"rope_scaling.{key} must list {head_dim // 2} numbers (rotary dims / 2), got {count}")
    factor = float(scaling["factor"])
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exps), float(attention)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``scale`` times (HF's ``get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: (inverse frequencies, attention factor), as HF's ``_compute_yarn_parameters``
    (``model_config`` fills ``original_max_position_embeddings`` and ``factor`` in)."""
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def yarn_softmax_scale(scale: float, scaling: Optional[dict[str, Any]]) -> float:
    """DeepSeek's attention scale: ``scale`` times ``yarn_mscale(factor, mscale_all_dim)`` squared
    under any rope scaling that sets ``mscale_all_dim`` (HF's ``yarn_apply_mscale``)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind != "default" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        return scale * m * m
    return scale


def interleaved_rope_order(rope_dim: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """For each rope dim as ingot holds it, the checkpoint dim it comes from: the even dims, then
    the odd ones, so that DeepSeek's rotated pairs ``(2i, 2i + 1)`` become neox pairs ``(i, i + d/2)``.
    q.k is unchanged by a permutation shared by q and k."""
    return torch.cat((torch.arange(0, rope_dim, 2, device=device), torch.arange(1, rope_dim, 2, device=device)))


def rope_frequencies(
    head_dim: int, base: float, scaling: Optional[dict[str, Any]], max_position: int = 0
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, factor on cos and sin) for a model's rope settings (HF
    ``rope_scaling`` dict); ``max_position`` (the context served) picks LongRoPE's set."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("su", "longrope"):
        return _longrope(head_dim, base, scaling, max_position)
    if kind == "yarn":
        return _yarn(head_dim, base, scaling)
    inv_freq = _inv_freq(head_dim, base)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    raise CheckpointError(f"unsupported rope_scaling.rope_type {kind!r} (supported: default, linear, llama3, longrope, yarn)")


def rope_inv_freq(head_dim: int, base: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    """The inverse frequencies for a model's rope settings (HF ``rope_scaling`` dict)."""
    return rope_frequencies(head_dim, base, scaling)[0]


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """For each dim of a head as ingot holds it, the HF dim it comes from: HF's rotated pairs
    ``(i, i + rotary_dim / 2)`` at ``(i, i + head_dim / 2)``, the passed dims after each half."""
    half, rot_half = head_dim // 2, rotary_dim // 2
    passed = list(range(rotary_dim, head_dim))
    cut = len(passed) // 2
    order = list(range(rot_half)) + passed[:cut] + list(range(rot_half, rotary_dim)) + passed[cut:]
    assert len(order) == head_dim and half - rot_half == cut
    return torch.tensor(order)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: Optional[dict[str, Any]] = None,
        rotary_dim: Optional[int] = None,
    ) -> None:
        """``rotary_dim`` (default ``head_dim``): the dims that rotate; the table's other columns
        are the identity (``partial_rotary_order`` lays q and k out to match)."""
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        if rotary_dim % 2 or (head_dim - rotary_dim) % 2 or rotary_dim > head_dim:
            raise CheckpointError(f"rotary dims {rotary_dim} of head_dim {head_dim}: both parts must be even "
                                  "(partial_rotary_factor)")
        inv_freq, attention = rope_frequencies(rotary_dim, base, scaling, max_position)
        pos = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * attention, freqs.sin() * attention
        passed = (head_dim - rotary_dim) // 2
        if passed:
            cos = torch.cat((cos, cos.new_ones(max_position, passed)), dim=-1)
            sin = torch.cat((sin, sin.new_zeros(max_position, passed)), dim=-1)
        self.register_buffer("cos_sin_cache", torch.cat((cos, sin), dim=-1), persistent=False)

    @classmethod
    def identity(cls, head_dim: int, max_position: int) -> "RotaryEmbedding":
        """A table that rotates nothing (SmolLM3's layers without rotary): one identity row seen
        at every position (stride 0), so those layers run the same ops at no memory cost."""
        rotary = cls.__new__(cls)
        nn.Module.__init__(rotary)
        row = torch.cat((torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)), dim=-1)
        rotary.register_buffer("cos_sin_cache", row.expand(max_position, head_dim), persistent=False)
        return rotary

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if policy.is_native("rotary"):
            return reference.rotary_embedding(positions, q, k, self.cos_sin_cache)
        return torch.ops.ingot.rotary_embedding(positions, q, k, self.cos_sin_cache)
