"""GGUF Q8_0 / Q4_0 / Q4_1 blocks -> the canonical int form, without dequantizing.

Each of these ggml types cuts a row into blocks of 32 values with an fp16 scale d
(Q4_1 also an fp16 min m), which is the canonical int form with a group of 32:

* Q8_0 (34 bytes: d, 32 int8 q): w = d * q; stored u = q + 128, zero 128;
* Q4_0 (18 bytes: d, 16 bytes of nibbles): w = d * (u - 8), zero 8;
* Q4_1 (20 bytes: d, m, 16 bytes of nibbles): w = d * u + m, zero 0, ``mins`` m.

Inside a 4-bit block byte j holds element j in its low nibble and element j + 16 in
its high one; the canonical packing wants elements 2i and 2i + 1 in one byte, so the
nibbles are regrouped. d and m stay fp16 (the ``scales`` / ``mins``).
"""

from __future__ import annotations

from typing import Optional

import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT

from ingot.loading.quant_pack import pack_int
from ingot.loading.quant_scheme import IntWeights

GROUP = 32
NATIVE_TYPES: dict[QT, IntWeights] = {
    QT.Q8_0: IntWeights(bits=8, group_size=GROUP, zero_point=128),
    QT.Q4_0: IntWeights(bits=4, group_size=GROUP, zero_point=8),
    QT.Q4_1: IntWeights(bits=4, group_size=GROUP, zero_point=0, has_mins=True),
}


def native_scheme(qtype: QT) -> Optional[IntWeights]:
    """The canonical scheme a tensor of ``qtype`` is served in, None where it is dequantized."""
    return NATIVE_TYPES.get(qtype)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at byte ``start`` of every block: [rows, blocks, bytes] -> [rows, blocks]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1)


def blocks_to_canonical(raw: torch.Tensor, qtype: QT) -> dict[str, torch.Tensor]:
    """One 2-D tensor's blocks (uint8 [N, K / 32 * block bytes], as ``read_raw_blocks`` gives them)
    -> qweight int32 [N, K * bits / 32], scales fp16 [N, K / 32] (and mins fp16 for Q4_1)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, type_size)
    scales = _half(blocks, 0)
    if qtype == QT.Q8_0:
        return {"qweight": pack_int((blocks[..., 2:] ^ 0x80).reshape(n, -1), 8), "scales": scales}
    start = 4 if qtype == QT.Q4_1 else 2
    qs = blocks[..., start : start + block // 2]
    u = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(n, -1)  # elements 0..15, then 16..31
    out = {"qweight": pack_int(u, 4), "scales": scales}
    if qtype == QT.Q4_1:
        out["mins"] = _half(blocks, 2)
    return out
