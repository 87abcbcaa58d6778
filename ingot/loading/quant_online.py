"""Online quantization: a dense checkpoint's linear weights quantized at load.

``quantize_online(scheme, linear_shapes)`` is the ``QuantConfig`` of a dense model
served quantized; ``quantize_weight`` turns one dense [N, K] weight into the canonical
tensors; ``online_weights`` wraps a checkpoint's weight iterator to do it while
loading. The schemes (round to nearest, no calibration):

* ``fp8``: what vLLM's ``--quantization fp8`` does to a bf16 checkpoint: one fp32
  scale per weight tensor (its largest magnitude / 448) and activations quantized to
  fp8 per token at run time (``Fp8Weights(0, 0, act_group=0)``);
* ``int8``: W8A16, one scale per output row, symmetric (scale = row max / 127, zero 128);
* ``int4``: W4A16, a scale per 128 input columns, symmetric (scale = group max / 7,
  values -7..7 stored as 1..15 around zero 8).

int scales are fp32, whatever the model dtype (so a bf16 checkpoint quantizes the same
for a bf16 GPU model and an fp32 CPU one), and each weight is within half a step of its
original.
Every 2-D projection is quantized, routed experts stored one tensor per expert and
projection included (held stacked and quantized by ``layers/fused_moe.py``); embeddings,
the lm_head, norms, MoE routers and the modules the model holds dense (the opener's
``held_dense``: DeepSeek's ``kv_b_proj``) stay dense, and so do experts stacked in one 3-D
tensor (GGUF ``ffn_*_exps``, transformers' fused ``experts.gate_up_proj``).
Since a per-row scheme's group is the module's own K, the config lists every
quantized module in ``per_module`` (``scheme`` is None: anything not listed is dense).
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch

from ingot.loading.errors import CheckpointError
from ingot.loading.quant_pack import FP8_MAX, canonical_names, dequantize, pack_int
from ingot.loading.quant_scheme import Fp8Weights, IntWeights, LinearScheme, QuantConfig
from ingot.loading.weights import WeightSelector, select as select_part

ONLINE_SCHEMES = ("fp8", "int8", "int4")
INT4_GROUP = 128
# module names (last component) never quantized online: embeddings, lm_head, MoE routers
_KEEP_DENSE = ("embed_tokens", "lm_head", "gate", "shared_expert_gate")

Weights = Callable[[torch.dtype, Optional[WeightSelector]], Iterator[tuple[str, torch.Tensor]]]


def is_online_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether checkpoint tensor ``name`` of ``shape`` is a weight online quantization converts."""
    module, _, part = name.rpartition(".")
    return part == "weight" and len(shape) == 2 and module.rpartition(".")[2] not in _KEEP_DENSE


def _scheme(scheme: str, module: str, k: int) -> LinearScheme:
    if scheme == "fp8":
        return Fp8Weights(block_n=0, block_k=0, act_group=0)
    if scheme == "int8":
        if k % 4:
            raise CheckpointError(f"int8 online quantization: {module} has {k} input features, not a multiple of 4")
        return IntWeights(bits=8, group_size=k)
    if k % INT4_GROUP:
        raise CheckpointError(f"int4 online quantization: {module} has {k} input features, "
                              f"not a multiple of the group size {INT4_GROUP}")
    return IntWeights(bits=4, group_size=INT4_GROUP)


def quantize_online(scheme: str, linear_shapes: Mapping[str, tuple[int, int]]) -> QuantConfig:
    """The QuantConfig of a dense model whose linear modules (HF module name -> [N, K] of
    its weight) are quantized at load with ``scheme`` (fp8, int8 or int4)."""
    if scheme not in ONLINE_SCHEMES:
        raise CheckpointError(f"unknown online quantization {scheme!r} (supported: {', '.join(ONLINE_SCHEMES)})")
    per_module = {m: _scheme(scheme, m, shape[1]) for m, shape in linear_shapes.items()}
    return QuantConfig("online", None, ("lm_head",), per_module)


def random_weights_config(scheme: str, held_dense: Sequence[str] = ()) -> QuantConfig:
    """The QuantConfig of a model with random weights (``load_format="dummy"``) served quantized:
    the same schemes as ``quantize_online`` for every linear module, routed experts included
    (int8's per-row group as ``group_size`` 0: the layer's own K), the modules it keeps dense
    and those the model holds dense (``held_dense``, QuantConfig.ignore's patterns) dense."""
    if scheme not in ONLINE_SCHEMES:
        raise CheckpointError(f"unknown online quantization {scheme!r} (supported: {', '.join(ONLINE_SCHEMES)})")
    linear = {"fp8": Fp8Weights(0, 0, act_group=0), "int8": IntWeights(bits=8, group_size=0),
              "int4": IntWeights(bits=4, group_size=INT4_GROUP)}[scheme]
    dense = tuple(f"re:(.*\\.)?{name}$" for name in _KEEP_DENSE)
    return QuantConfig("online", linear, dense + tuple(held_dense))


def quantize_weight(weight: torch.Tensor, scheme: LinearScheme) -> dict[str, torch.Tensor]:
    """A dense [N, K] weight -> the canonical tensors of ``scheme`` (weight-only symmetric int, or fp8)."""
    w = weight.float()
    if isinstance(scheme, Fp8Weights):
        amax = w.abs().amax()
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale.reshape(1, 1)}
    n, k = w.shape
    g = scheme.group_size
    qmax = 2 ** (scheme.bits - 1) - 1
    groups = w.reshape(n, k // g, g)
    amax = groups.abs().amax(-1)
    scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(groups / scales.unsqueeze(-1)).clamp(-qmax - 1, qmax)
    u = (q + scheme.default_zero).to(torch.uint8).reshape(n, k)
    return {"qweight": pack_int(u, scheme.bits), "scales": scales}


def online_weights(weights: Weights, quant: QuantConfig, dequantize_all: bool = False) -> Weights:
    """``weights`` with each module of ``quant.per_module`` quantized: read whole, converted,
    then cut by the selector under its canonical names (``dequantize_all``: dequantized back
    to a dense ``weight`` in the model dtype, the quantization's rounding kept)."""

    def iterate(dtype: torch.dtype, select: Optional[WeightSelector] = None) -> Iterator[tuple[str, torch.Tensor]]:
        def whole(name: str):
            if name.endswith(".weight") and quant.per_module.get(name[: -len(".weight")]) is not None:
                return None
            return select(name) if select is not None else None

        for name, tensor in weights(dtype, whole):
            scheme = quant.per_module.get(name[: -len(".weight")]) if name.endswith(".weight") else None
            if scheme is None:
                yield name, tensor
                continue
            module = name[: -len(".weight")]
            canonical = quantize_weight(tensor, scheme)
            if dequantize_all:
                yield name, select_part(dequantize(canonical, scheme, dtype), name, select)
                continue
            for part, t in canonical.items():
                yield f"{module}.{part}", select_part(t, f"{module}.{part}", select)

    return iterate


def online_tensor_count(dense_count: int, quant: QuantConfig) -> int:
    """The number of tensors ``online_weights`` yields for a checkpoint of ``dense_count``."""
    return dense_count + sum(len(canonical_names(s)) - 1 for s in quant.per_module.values() if s is not None)
