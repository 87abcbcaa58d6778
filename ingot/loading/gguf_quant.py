"""GGUF blocks -> the canonical int form, exactly, without dequantizing.

Every ggml type ingot reads is unsigned integers u, a float scale per small group and a
zero point or an added min, which is the canonical int form (``quant_scheme.IntWeights``):

* Q8_0 (d, 32 int8 q): w = d * q; u = q + 128, zero 128;
* Q4_0 / Q5_0 (d, 4- / 5-bit u): w = d * (u - 8) / d * (u - 16);
* Q4_1 / Q5_1 (d, m, 4- / 5-bit u): w = d * u + m: zero 0, ``mins`` m;
* Q4_K / Q5_K (super-blocks of 256: fp16 d and dmin, 6-bit sc and m per 32 values, 4- / 5-bit
  u): w = (d * sc) * u - dmin * m: group 32, scale d * sc, min -(dmin * m), zero 0;
* Q6_K (super-blocks of 256: fp16 d, int8 sc per 16 values, 6-bit u): w = (d * sc) * (u - 32):
  group 16, scale d * sc, zero 32.

5- and 6-bit values are held in 8 bits (the kernels unpack 4 or 8). The scales of the first
five types stay their fp16 d (and m); the K-quants' products d * sc and dmin * m need up to
18 significant bits, so they are fp32, where they are exact: ``(u - zero) * scale (+ min)``
in fp32 is then, operation for operation, what ``gguf.quants.dequantize`` computes.

One projection ingot holds as one (q/k/v, gate/up, a layer's experts) may come in several
types (llama.cpp's Q4_K_M gives some layers' attn_v Q6_K, their q/k Q4_K). ``common_form``
then restates every shard in one form: the widest bits, the smallest group (scales and mins
repeated), zero point 0 with the shard's zero point folded into its mins
(min - zero * scale), fp32 scales and mins. That is exact too: zero points are powers of two
and u * scale has at most 6 + 18 bits, so each product and the sum (a weight the type itself
represents in fp32) are exact.

MXFP4 (gpt-oss's experts: blocks of 32 e2m1 values, one e8m0 exponent byte, then 16 bytes
holding value j in the low and value j + 16 in the high nibble of byte j) is not an int form:
it becomes ingot's fp8 one, exactly, as the HF MXFP4 checkpoints do (``mxfp4.py``: e4m3 codes
and one fp32 power-of-two scale per 32 columns). It never shares a form with another type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Optional

import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT

from ingot.loading.mxfp4 import SCHEME as MXFP4_SCHEME
from ingot.loading.mxfp4 import mxfp4_to_fp8
from ingot.loading.quant_pack import pack_int
from ingot.loading.quant_scheme import IntWeights, LinearScheme


@dataclass(frozen=True)
class Form:
    """The canonical form a GGUF tensor is served in: its scheme and its scales' (and mins') dtype."""

    scheme: LinearScheme
    scale_dtype: torch.dtype


_F16, _F32 = torch.float16, torch.float32
NATIVE_FORMS: dict[QT, Form] = {
    QT.Q8_0: Form(IntWeights(bits=8, group_size=32, zero_point=128), _F16),
    QT.Q4_0: Form(IntWeights(bits=4, group_size=32, zero_point=8), _F16),
    QT.Q4_1: Form(IntWeights(bits=4, group_size=32, zero_point=0, has_mins=True), _F16),
    QT.Q5_0: Form(IntWeights(bits=8, group_size=32, zero_point=16), _F16),
    QT.Q5_1: Form(IntWeights(bits=8, group_size=32, zero_point=0, has_mins=True), _F16),
    QT.Q4_K: Form(IntWeights(bits=4, group_size=32, zero_point=0, has_mins=True), _F32),
    QT.Q5_K: Form(IntWeights(bits=8, group_size=32, zero_point=0, has_mins=True), _F32),
    QT.Q6_K: Form(IntWeights(bits=8, group_size=16, zero_point=32), _F32),
    QT.MXFP4: Form(MXFP4_SCHEME, _F32),
}


def native_form(qtype: QT) -> Optional[Form]:
    """The form a tensor of ``qtype`` is served in alone, None where it is dequantized (float types)."""
    return NATIVE_FORMS.get(qtype)


def common_form(qtypes: Collection[QT]) -> Optional[Form]:
    """The one form that holds tensors of every type in ``qtypes`` exactly (see the module
    docstring); None when one of them has no native form, or MXFP4 comes with another type."""
    forms = {native_form(t) for t in qtypes}
    if None in forms:
        return None
    if len(forms) == 1:
        return forms.pop()
    schemes = [f.scheme for f in forms if isinstance(f.scheme, IntWeights)]
    if len(schemes) < len(forms):  # MXFP4 with another type
        return None
    bits, group = max(s.bits for s in schemes), min(s.group_size for s in schemes)
    return Form(IntWeights(bits=bits, group_size=group, zero_point=0, has_mins=True), _F32)


# ---------------------------------------------------------------- decoding blocks

Decoded = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]  # u uint8 [N, K], scales, mins [N, K / group]


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at byte ``start`` of every block: [rows, blocks, bytes] -> [rows, blocks]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., c] -> [..., 2, c]: their low nibbles, then their high ones (ggml's order)."""
    return torch.stack((qs & 0xF, qs >> 4), dim=-2)


def _bits(qh: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Bytes [..., c] -> [..., count, c]: field i holds bits [i * width, (i + 1) * width) of each byte."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8).reshape(count, 1)
    return (qh.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _legacy(blocks: torch.Tensor, qtype: QT) -> Decoded:
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: blocks of 32 [n, B, bytes] -> u, d (and m)."""
    n = blocks.shape[0]
    d = _half(blocks, 0)
    if qtype == QT.Q8_0:
        return (blocks[..., 2:] ^ 0x80).reshape(n, -1), d, None
    has_min = qtype in (QT.Q4_1, QT.Q5_1)
    start = 4 if has_min else 2
    if qtype in (QT.Q5_0, QT.Q5_1):  # 4 bytes of high bits (bit e of the little-endian word: element e)
        high = _bits(blocks[..., start : start + 4], 8, 1).transpose(-1, -2).reshape(n, -1, 32)
        start += 4
    u = _nibbles(blocks[..., start : start + 16]).reshape(n, -1, 32)  # elements 0..15, then 16..31
    if qtype in (QT.Q5_0, QT.Q5_1):
        u = u | (high << 4)
    return u.reshape(n, -1), d, _half(blocks, 2) if has_min else None


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> [..., 8] each (ggml's get_scale_min_k4)."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q45_k(blocks: torch.Tensor, qtype: QT) -> Decoded:
    """Q4_K / Q5_K super-blocks [n, B, bytes] -> u, d * sc and -(dmin * m) (fp32, per 32 values)."""
    n, nb = blocks.shape[:2]
    sc, mn = _k_scale_min(blocks[..., 4:16])
    start = 16 if qtype == QT.Q4_K else 48
    u = _nibbles(blocks[..., start : start + 128].reshape(n, nb, 4, 32)).reshape(n, nb, 8, 32)
    if qtype == QT.Q5_K:  # bit j of byte i: the fifth bit of value i of sub-block j
        u = u | (_bits(blocks[..., 16:48], 8, 1) << 4)
    scales = _half(blocks, 0).float()[..., None] * sc
    mins = -(_half(blocks, 2).float()[..., None] * mn)
    return u.reshape(n, -1), scales.reshape(n, -1), mins.reshape(n, -1)


def _q6_k(blocks: torch.Tensor, qtype: QT) -> Decoded:
    """Q6_K super-blocks [n, B, 210] -> u (zero 32), d * sc (fp32, per 16 values)."""
    n, nb = blocks.shape[:2]
    low = _nibbles(blocks[..., 0:128].reshape(n, nb, 2, 64)).reshape(n, nb, 8, 32)
    high = _bits(blocks[..., 128:192].reshape(n, nb, 2, 32), 4, 2).reshape(n, nb, 8, 32)
    scales = _half(blocks, 208).float()[..., None] * blocks[..., 192:208].view(torch.int8)
    return (low | (high << 4)).reshape(n, -1), scales.reshape(n, -1), None


_DECODERS: dict[QT, Callable[[torch.Tensor, QT], Decoded]] = {
    **{t: _legacy for t in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)},
    QT.Q4_K: _q45_k,
    QT.Q5_K: _q45_k,
    QT.Q6_K: _q6_k,
}


def blocks_to_canonical(raw: torch.Tensor, qtype: QT, form: Optional[Form] = None) -> dict[str, torch.Tensor]:
    """One 2-D tensor's blocks (uint8 [N, K / block * block bytes], as ``read_raw_blocks`` gives
    them) -> qweight int32 [N, K * bits / 32], scales (and mins) [N, K / group], in ``form``
    (None: ``qtype``'s native form; else one ``common_form`` gave for it); MXFP4's: weight (fp8)
    and weight_scale."""
    if qtype == QT.MXFP4:
        return _mxfp4_to_canonical(raw)
    native = NATIVE_FORMS[qtype]
    form = form or native
    assert isinstance(form.scheme, IntWeights) and isinstance(native.scheme, IntWeights)
    _, type_size = GGML_QUANT_SIZES[qtype]
    u, scales, mins = _DECODERS[qtype](raw.reshape(raw.shape[0], -1, type_size), qtype)
    src, dst = native.scheme, form.scheme
    if dst.group_size != src.group_size:
        scales = scales.repeat_interleave(src.group_size // dst.group_size, dim=1)
        mins = None if mins is None else mins.repeat_interleave(src.group_size // dst.group_size, dim=1)
    if dst.default_zero != src.default_zero:  # fold the zero point into the mins (exact: see the module docstring)
        shift = (dst.default_zero - src.default_zero) * scales.to(form.scale_dtype)
        mins = shift if mins is None else mins.to(form.scale_dtype) + shift
    out = {"qweight": pack_int(u, dst.bits), "scales": scales.to(form.scale_dtype)}
    if dst.has_mins:
        out["mins"] = mins.to(form.scale_dtype) if mins is not None else torch.zeros_like(out["scales"])
    return out


def _mxfp4_to_canonical(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """MXFP4 blocks (uint8 [N, K / 32 * 17]) -> ``weight`` float8 e4m3 [N, K] and ``weight_scale``
    fp32 [N, K / 32], through the HF MXFP4 conversion: ggml's nibble order (value j low, j + 16
    high) restated as HF's (values 2j, 2j + 1 in byte j)."""
    blocks = raw.reshape(raw.shape[0], -1, 17)
    exponents, packed = blocks[..., 0], blocks[..., 1:]
    codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1)  # [N, K / 32, 32] in column order
    weight, scale = mxfp4_to_fp8(codes[..., 0::2] | (codes[..., 1::2] << 4), exponents)
    return {"weight": weight, "weight_scale": scale}
