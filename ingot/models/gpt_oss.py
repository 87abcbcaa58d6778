"""gpt-oss (``GptOssForCausalLM``): the MoE decoder of ``moe.py`` with gpt-oss's fields set.

Everything that differs is a ModelConfig flag read by the shared layers: attention sinks
(``LlamaAttention.sinks``, one logit per query head in the softmax's denominator), q/k/v
and o_proj biases, sliding windows alternating with full attention (``layer_types``),
YaRN rotary, a router with a bias whose softmax runs over the k largest logits, and
experts with biases and the clamped SwiGLU (``FusedMoE``'s epilogue). This module only
maps the checkpoint's names and layouts onto ingot's:

* ``mlp.router`` is the MoE block's ``gate``;
* transformers' experts are stacked and transposed, ``experts.gate_up_proj [E, H, 2I]``
  with gate at even and up at odd columns (``gate_up_proj_bias [E, 2I]`` likewise) and
  ``experts.down_proj [E, I, H]``: they are transposed to ``[E, 2I, H]`` / ``[E, H, I]``
  and gate/up de-interleaved into gate rows then up rows, as ``FusedMoE`` holds them;
* MXFP4 checkpoints (``loading/mxfp4.py``) arrive per expert in ingot's orientation already.

RMSNorm: HF multiplies by the weight in fp32 before rounding, ingot rounds first (as Llama
does): the same in fp32, within a bf16 rounding in bf16.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from ingot.loading.errors import CheckpointError
from ingot.loading.model_config import ModelConfig
from ingot.models.moe import MoEForCausalLM

# transformers' stacked expert tensors: (layer, projection, "_bias" or "")
_HF_EXPERTS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


def gpt_oss_tensor_parallel_error(cfg: ModelConfig, size: int) -> Optional[str]:
    """gpt-oss runs on one device: its sinks, expert biases and transposed stacked experts are
    not split over ranks."""
    return "gpt-oss is served on a single device (attention sinks and expert biases are not split over ranks)"


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate at even, up at odd positions of ``dim`` -> gate's then up's."""
    even = t.narrow(dim, 0, t.shape[dim] // 2 * 2)
    idx = torch.arange(t.shape[dim], device=t.device)
    return torch.cat([even.index_select(dim, idx[0::2]), even.index_select(dim, idx[1::2])], dim=dim)


class GptOssForCausalLM(MoEForCausalLM):
    FUSED = {**MoEForCausalLM.FUSED, "router": ("gate", 0)}
    tensor_parallel_error = staticmethod(gpt_oss_tensor_parallel_error)

    @staticmethod
    def _ingot_layout(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """A checkpoint expert tensor in transformers' layout -> (ingot's name, tensor in FusedMoE's
        layout); any other tensor unchanged."""
        m = _HF_EXPERTS.match(name)
        if m is None:
            return name, tensor
        owner, proj, bias = m.groups()
        if bias:
            tensor = _deinterleave(tensor, -1) if proj == "gate_up_proj" else tensor
            return f"{owner}.{proj}.bias", tensor
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected a stacked [E, in, out] tensor, got shape {tuple(tensor.shape)}")
        tensor = tensor.transpose(-1, -2)
        return f"{owner}.{proj}", _deinterleave(tensor, -2) if proj == "gate_up_proj" else tensor

    def load_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        try:
            name, tensor = self._ingot_layout(name, tensor)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        return super().load_tensor(name, tensor)
