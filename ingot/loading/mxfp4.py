"""MXFP4 experts (gpt-oss checkpoints, ``quantization_config: {"quant_method": "mxfp4"}``) read
into ingot's canonical fp8 form, exactly.

The file stores each layer's routed experts stacked, as transformers' ``Mxfp4GptOssExperts``
reads them: ``mlp.experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H / 32, 16]`` (two e2m1 values a
byte, the low nibble first; gate rows at even and up rows at odd indices) with
``gate_up_proj_scales`` uint8 ``[E, 2I, H / 32]`` (e8m0: the block's scale is ``2 ** (s - 127)``),
and ``down_proj_blocks`` / ``down_proj_scales`` likewise over ``[E, H, I / 32]``. Everything else
(attention, router, the experts' biases, embeddings) is dense.

Every e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) is a float8 e4m3 value, and
an e8m0 scale is a power of two, exact in fp32: each expert's weight becomes ``Fp8Weights(
block_n=1, block_k=32)`` (the fp8 codes, one fp32 scale per row and 32 columns) with no
rounding, served by ``fused_moe_fp8`` (W8A16) where ingot keeps weights quantized (CUDA).
Dequantized at load (CPU), the dense weight is the same product in the model dtype (exact in
bf16 and fp32 too, up to their range). The experts are yielded one expert and projection at a
time under the per-expert names the MoE models load (``experts.3.gate_proj.weight`` ...), gate and
up rows already separated.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open

from ingot.loading.errors import CheckpointError
from ingot.loading.hf import tensor_table
from ingot.loading.quant_config import HFQuant
from ingot.loading.quant_pack import dequantize_fp8
from ingot.loading.quant_scheme import Fp8Weights, QuantConfig
from ingot.loading.weights import WeightSelector, select as select_part

# e2m1 code -> value (bit 3 the sign, bits 1-2 the exponent, bit 0 the mantissa)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per e8m0 scale
SCHEME = Fp8Weights(block_n=1, block_k=BLOCK)
# only the routed experts are quantized: every other module is dense
_DENSE = "re:^(?!.*\\.mlp\\.experts\\.)"
_PACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales)$")
_KNOWN_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


def is_mxfp4(quantization_config: object) -> bool:
    return isinstance(quantization_config, dict) and str(quantization_config.get("quant_method", "")).lower() == "mxfp4"


def mxfp4_to_fp8(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 blocks [..., N, K / 32, 16] and e8m0 scales [..., N, K / 32] -> (float8 e4m3 [..., N, K],
    fp32 scales [..., N, K / 32]): the same values, exactly (value = fp8 * scale)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                              f"(expected blocks [..., N, K / {BLOCK}, {BLOCK // 2}])")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # low nibble first
    values = lut[codes].reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
    scale = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 127)
    return values.to(torch.float8_e4m3fn), scale


def _check_config(qc: dict) -> None:
    unknown = sorted(set(qc) - _KNOWN_KEYS)
    if unknown:
        raise CheckpointError(f"quantization_config (mxfp4): unsupported field(s) {', '.join(unknown)}; "
                              f"ingot reads {', '.join(sorted(_KNOWN_KEYS))}")


class Mxfp4Safetensors:
    """The weights of an MXFP4 checkpoint: experts in the canonical fp8 form (or dequantized),
    every other tensor as stored, cast to the model dtype. ``QuantizedSafetensors``' interface."""

    def __init__(self, files: list[Path], quantization_config: dict) -> None:
        _check_config(quantization_config)
        self.files = files
        self.table = tensor_table(files)
        self.spec = HFQuant("mxfp4", (), (_DENSE,))
        self.layers: dict[str, dict[str, str]] = {}  # experts module -> {projection_part: tensor name}
        for name in self.table:
            m = _PACKED.match(name)
            if m is not None:
                self.layers.setdefault(m.group(1), {})[f"{m.group(2)}_{m.group(3)}"] = name
            elif name.endswith(("_blocks", "_scales")):
                raise CheckpointError(f"checkpoint tensor {name!r}: only the routed experts' gate_up_proj and "
                                      "down_proj may be MXFP4 (blocks and scales)")
        for module, parts in self.layers.items():
            missing = {f"{p}_{s}" for p in ("gate_up_proj", "down_proj") for s in ("blocks", "scales")} - set(parts)
            if missing:
                raise CheckpointError(f"{module}: MXFP4 experts lack {', '.join(sorted(missing))}")
        self.quant = QuantConfig("mxfp4", SCHEME, (_DENSE,)) if self.layers else None

    def _experts(self, module: str) -> int:
        return self.table[self.layers[module]["down_proj_blocks"]][1][0]

    def num_tensors(self, dequantize_all: bool = False) -> int:
        packed = sum(len(parts) for parts in self.layers.values())
        per_expert = 3 if dequantize_all else 6  # gate, up, down: weight (and weight_scale)
        return len(self.table) - packed + sum(per_expert * self._experts(m) for m in self.layers)

    def weights(self, dtype: torch.dtype, select: Optional[WeightSelector] = None,
                dequantize_all: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor): dense tensors as stored (cast to ``dtype``), each layer's experts
        once its four packed tensors are read, per expert and projection."""
        with contextlib.ExitStack() as stack:
            handles = {file: stack.enter_context(safe_open(str(file), framework="pt")) for file in self.files}
            for file, handle in handles.items():
                try:
                    for name in handle.keys():
                        m = _PACKED.match(name)
                        if m is None:
                            index = select(name) if select is not None else None
                            tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
                            yield name, tensor.to(dtype)
                        elif name == self.layers[m.group(1)]["down_proj_blocks"]:  # once per layer
                            raw = {part: handles[self.table[n][0]].get_tensor(n) for part, n in self.layers[m.group(1)].items()}
                            yield from self._expert_tensors(m.group(1), raw, dtype, select, dequantize_all)
                except (SafetensorError, OSError) as exc:
                    raise CheckpointError(f"corrupt or truncated safetensors file {file}: {exc}") from None

    def _expert_tensors(self, module: str, raw: dict[str, torch.Tensor], dtype: torch.dtype,
                        select: Optional[WeightSelector], dequantize_all: bool) -> Iterator[tuple[str, torch.Tensor]]:
        gate_up = mxfp4_to_fp8(raw["gate_up_proj_blocks"], raw["gate_up_proj_scales"])
        down = mxfp4_to_fp8(raw["down_proj_blocks"], raw["down_proj_scales"])
        for e in range(down[0].shape[0]):
            for proj, rows, (w, s) in (("gate_proj", slice(0, None, 2), gate_up), ("up_proj", slice(1, None, 2), gate_up),
                                       ("down_proj", slice(None), down)):
                canonical = {"weight": w[e, rows], "weight_scale": s[e, rows]}
                prefix = f"{module}.{e}.{proj}"
                if dequantize_all:
                    yield f"{prefix}.weight", select_part(dequantize_fp8(canonical, SCHEME, dtype), f"{prefix}.weight", select)
                    continue
                for part, tensor in canonical.items():
                    yield f"{prefix}.{part}", select_part(tensor.contiguous(), f"{prefix}.{part}", select)
