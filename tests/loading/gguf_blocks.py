"""Random ggml quantization blocks, and scalar dequantizers written from ggml's block
layouts: an independent reference for the GGUF reader's dequantization."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from tests.loading.gguf_fixtures import RNG


def f16_bits(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(qtype: QT, n: int, f16_at: tuple[int, ...]) -> np.ndarray:
    """n random blocks of qtype with sane (finite, small) f16 scales at the given byte offsets."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = RNG.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in f16_at:
        blocks[:, at : at + 2] = f16_bits(RNG.uniform(0.001, 0.05, size=n))
    return blocks


def f16(b: np.ndarray, at: int) -> float:
    return float(b[at : at + 2].view(np.float16)[0])


def ref_q8_0(b: np.ndarray) -> list[float]:
    return [f16(b, 0) * int(v) for v in b[2:34].view(np.int8)]


def ref_q4_0(b: np.ndarray) -> list[float]:
    d, qs = f16(b, 0), [int(q) for q in b[2:18]]
    return [d * ((q & 15) - 8) for q in qs] + [d * ((q >> 4) - 8) for q in qs]


def ref_q4_1(b: np.ndarray) -> list[float]:
    d, m, qs = f16(b, 0), f16(b, 2), [int(q) for q in b[4:20]]
    return [d * (q & 15) + m for q in qs] + [d * (q >> 4) + m for q in qs]


def k_scale_min(j: int, s: np.ndarray) -> tuple[int, int]:
    """6-bit (scale, min) of sub-block j, packed in 12 bytes for 8 sub-blocks."""
    s = [int(x) for x in s]
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def ref_q4_k(b: np.ndarray) -> list[float]:
    d, dmin, scales, qs = f16(b, 0), f16(b, 2), b[4:16], b[16:144]
    out = []
    for chunk in range(4):  # 64 values per chunk: low nibbles then high nibbles of 32 bytes
        q = qs[32 * chunk : 32 * chunk + 32]
        for sub, shift in ((2 * chunk, 0), (2 * chunk + 1, 4)):
            sc, mn = k_scale_min(sub, scales)
            out += [d * sc * ((int(x) >> shift) & 15) - dmin * mn for x in q]
    return out


def ref_q5_k(b: np.ndarray) -> list[float]:
    d, dmin, scales, qh, qs = f16(b, 0), f16(b, 2), b[4:16], b[16:48], b[48:176]
    out = []
    for chunk in range(4):
        q = qs[32 * chunk : 32 * chunk + 32]
        for half, shift in ((0, 0), (1, 4)):
            sub = 2 * chunk + half
            sc, mn = k_scale_min(sub, scales)
            out += [d * sc * (((int(x) >> shift) & 15) + 16 * ((int(h) >> sub) & 1)) - dmin * mn for x, h in zip(q, qh)]
    return out


def ref_q6_k(b: np.ndarray) -> list[float]:
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), f16(b, 208)
    out = [0.0] * 256
    for half in range(2):  # 128 values each, from 64 ql bytes, 32 qh bytes and 8 scales
        L, H, S = ql[64 * half :], qh[32 * half :], sc[8 * half :]
        for i in range(32):
            lo, hi, h = int(L[i]), int(L[i + 32]), int(H[i])
            vals = [(lo & 15) | ((h & 3) << 4), (hi & 15) | (((h >> 2) & 3) << 4), (lo >> 4) | (((h >> 4) & 3) << 4), (hi >> 4) | (((h >> 6) & 3) << 4)]
            for k, v in enumerate(vals):
                out[128 * half + 32 * k + i] = d * int(S[i // 16 + 2 * k]) * (v - 32)
    return out


REFERENCES = {
    QT.Q8_0: (ref_q8_0, (0,)),
    QT.Q4_0: (ref_q4_0, (0,)),
    QT.Q4_1: (ref_q4_1, (0, 2)),
    QT.Q4_K: (ref_q4_k, (0, 2)),
    QT.Q5_K: (ref_q5_k, (0, 2)),
    QT.Q6_K: (ref_q6_k, (208,)),
}
