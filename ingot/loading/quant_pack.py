"""The canonical quantized forms' bit layout, as the loading layer needs it.

The formats' converters (``quant_formats``, ``gguf_quant``, ``quant_online``) end in
the tensors that ``quant_scheme`` describes; this module packs and unpacks their int32
words and turns a module's canonical tensors back into a dense weight (for
``dequantize_on_load``). It restates the few lines of ``ops/reference.py`` that do the
same, because the loading layer may not import the ops layer; the tests check the two
against each other.

Packing works on bytes: an int32 word of 4-bit values is 4 bytes, each holding two
values (the even one in the low nibble), and one of 8-bit values is 4 bytes of one
value each, in little-endian order, which is what a byte view of the words gives on
the (little-endian) hosts torch runs on.
"""

from __future__ import annotations

import sys
from typing import Mapping, Optional

import torch

from ingot.loading.quant_scheme import Fp8Weights, IntWeights, LinearScheme

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("ingot's quantized-checkpoint loading assumes a little-endian host")

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def pack_int(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit values [N, K] (any integer dtype, K a multiple of 32 / bits)
    -> int32 [N, K * bits / 32], element k in bits ``(k * bits) % 32`` of word ``k * bits // 32``."""
    n, k = values.shape
    if bits not in (4, 8) or k % (32 // bits):
        raise ValueError(f"cannot pack {k} {bits}-bit values per row into int32 words")
    v = values.to(torch.uint8)
    if bits == 4:
        v = v[:, 0::2] | (v[:, 1::2] << 4)
    return v.contiguous().view(torch.int32).reshape(n, k * bits // 32)


def unpack_int(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``pack_int``: int32 [N, W] -> the unsigned values [N, W * 32 / bits] (uint8)."""
    n = qweight.shape[0]
    b = qweight.contiguous().view(torch.uint8).reshape(n, -1)
    if bits == 8:
        return b
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(n, -1)


def _per_group(t: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    return t.float().repeat_interleave(group_size, dim=1)[:, :k]


def dequantize_int(tensors: Mapping[str, torch.Tensor], scheme: IntWeights, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight of a module's canonical int tensors, in the checkpoint's
    column order (``perm`` undone): ``(u - zero) * scale (+ min)`` in fp32, rounded once."""
    u = unpack_int(tensors["qweight"], scheme.bits).float()
    k = u.shape[1]
    zeros = tensors.get("zeros")
    zero = _per_group(zeros, scheme.group_size, k) if zeros is not None else float(scheme.default_zero)
    w = (u - zero) * _per_group(tensors["scales"], scheme.group_size, k)
    mins = tensors.get("mins")
    if mins is not None:
        w = w + _per_group(mins, scheme.group_size, k)
    perm = tensors.get("perm")
    if perm is not None:  # column j of the stored weight is column perm[j] of the checkpoint's
        w = torch.empty_like(w).index_copy_(1, perm, w)
    return w.to(dtype)


def dequantize_fp8(tensors: Mapping[str, torch.Tensor], scheme: Fp8Weights, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight of a module's canonical fp8 tensors: each element times its block's scale."""
    weight = tensors["weight"]
    n, k = weight.shape
    bn, bk = scheme.block_n or n, scheme.block_k or k
    scale = tensors["weight_scale"].float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (weight.float() * scale).to(dtype)


def dequantize(tensors: Mapping[str, torch.Tensor], scheme: LinearScheme, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(scheme, Fp8Weights):
        return dequantize_fp8(tensors, scheme, dtype)
    return dequantize_int(tensors, scheme, dtype)


def canonical_names(scheme: Optional[LinearScheme]) -> tuple[str, ...]:
    """The tensors a module of ``scheme`` holds (None: a dense module's ``weight``)."""
    if scheme is None:
        return ("weight",)
    if isinstance(scheme, Fp8Weights):
        return ("weight", "weight_scale")
    names = ["qweight", "scales"]
    names += ["zeros"] * scheme.has_zeros + ["mins"] * scheme.has_mins + ["perm"] * scheme.act_order
    return tuple(names)
