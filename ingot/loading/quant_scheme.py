"""How a model's linear weights are quantized, whatever file format they came in.

Every quantized checkpoint ingot serves (compressed-tensors, AutoAWQ, GPTQ, HF FP8,
GGUF blocks) and the online quantization of a bf16 model end in one of two
canonical forms, which the layers hold and the ``torch.ops.ingot`` kernels read;
the format's own layout is converted once, at load.

``IntWeights`` (weight-only int4 / int8, activations in the model dtype): a
projection of N outputs and K inputs holds

* ``qweight`` int32 [N, K * bits / 32]: unsigned b-bit values packed along K,
  little-endian (element k in bits ``(k * bits) % 32`` of word ``k * bits // 32``:
  compressed-tensors' ``pack-quantized`` order);
* ``scales`` [N, K / group_size] (fp16, bf16 or fp32, as the checkpoint stores them);
* ``zeros`` uint8 [N, K / group_size] when ``has_zeros`` (unsigned zero points), else
  every group's zero point is ``zero_point``;
* ``mins`` [N, K / group_size] when ``has_mins`` (GGUF Q4_1: added after scaling);
* ``perm`` int64 [K] when ``act_order`` (GPTQ ``desc_act``): the weights' columns are
  sorted by group, so the layer feeds ``x[:, perm]``.

A weight is ``(u - zero) * scale (+ min)``, computed in fp32 and rounded once to the
model dtype: exactly what the formats' own dequantization gives for integer zero points.

``Fp8Weights`` (float8 e4m3 weights): ``weight`` float8_e4m3fn [N, K] and
``weight_scale`` fp32 [ceil(N / block_n), ceil(K / block_k)], one scale per block
(per tensor: the block is the whole matrix; per channel: one row). With dynamic
activations (W8A8, ``act_group >= 0``) each activation row (``act_group`` 0) or each
group of ``act_group`` columns of a row is quantized to fp8 at run time with its own
scale; with ``act_group`` -1 (W8A16) activations stay in the model dtype.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping, Optional, Union


@dataclass(frozen=True)
class IntWeights:
    bits: int  # 4 or 8
    group_size: int  # input features per scale; K (the whole row) for per-channel scales (0: each layer's K)
    zero_point: int = -1  # the zero point of every group without ``zeros``; -1: 2 ** (bits - 1)
    has_zeros: bool = False
    has_mins: bool = False
    act_order: bool = False

    @property
    def default_zero(self) -> int:
        return 2 ** (self.bits - 1) if self.zero_point < 0 else self.zero_point

    @property
    def pack(self) -> int:
        """Values per int32 word."""
        return 32 // self.bits


@dataclass(frozen=True)
class Fp8Weights:
    block_n: int = 0  # output rows per scale; 0: all of them
    block_k: int = 0  # input columns per scale; 0: all of them
    act_group: int = -1  # -1: activations in the model dtype; 0: fp8 per token; g: per token and g columns

    def grid(self, n: int, k: int) -> tuple[int, int]:
        """The shape of ``weight_scale`` for an [n, k] weight."""
        bn, bk = self.block_n or n, self.block_k or k
        return -(-n // bn), -(-k // bk)


LinearScheme = Union[IntWeights, Fp8Weights]


@dataclass(frozen=True)
class QuantConfig:
    """The quantization of a model's linear layers: one scheme, and the modules left in the
    model dtype (``ignore``: fnmatch patterns or ``re:`` regular expressions over module names
    such as ``model.layers.0.mlp.gate``; the lm_head by default). ``per_module`` names the
    scheme of single modules where a file mixes them (GGUF: a type per tensor; None: dense)."""

    method: str  # where it came from: compressed-tensors, awq, gptq, fp8, gguf, online
    scheme: Optional[LinearScheme]
    ignore: tuple[str, ...] = field(default=("lm_head",))
    per_module: Mapping[str, Optional[LinearScheme]] = field(default_factory=lambda: MappingProxyType({}))

    def scheme_for(self, module: str) -> Optional[LinearScheme]:
        """The scheme of the linear module ``module`` (HF name), None where it stays unquantized."""
        if module in self.per_module:
            return self.per_module[module]
        return None if module_matches(module, self.ignore) else self.scheme


def module_matches(module: str, patterns: Iterable[str]) -> bool:
    """Whether one of ``patterns`` names the module ``module`` (HF name, with or without
    ``model.``): an fnmatch pattern, a ``re:`` regular expression matched from the start, or
    a name that ends it after a dot (``self_attn.kv_b_proj``)."""
    short = module.removeprefix("model.")
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module) or re.match(pattern[3:], short):
                return True
        elif fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(short, pattern) or module.endswith("." + pattern):
            return True
    return False
