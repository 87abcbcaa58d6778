"""GGUF K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 converted into the canonical int form.

gguf-py has no K-quant quantizer, so the blocks are built here: random values, sub-scales and
mins, small positive fp16 d (subnormal ones included). The canonical tensors, dequantized by the
ops' reference math (what ``int_linear`` computes on CPU), must equal ``gguf.quants.dequantize``
bit for bit, alone and restated in the common form of a projection whose shards differ in type.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ingot.loading.gguf_quant import blocks_to_canonical, common_form, native_form
from ingot.loading.quant_scheme import IntWeights
from ingot.ops.reference import dequantize_int

RNG = np.random.default_rng(7)
# byte offsets of each block's fp16 d (and dmin / m), and the largest |sc * q| (or |q|) a block can have
F16_AT = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q4_K: (0, 2),
          QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
SPAN = {QT.Q8_0: 128, QT.Q4_0: 8, QT.Q4_1: 15, QT.Q5_0: 16, QT.Q5_1: 31, QT.Q4_K: 63 * 15, QT.Q5_K: 63 * 31,
        QT.Q6_K: 128 * 32}


def random_blocks(values: np.ndarray, qtype: QT, magnitude: float = 0.1) -> np.ndarray:
    """Valid random blocks of ``qtype`` for a float tensor of ``values``' shape (its values unused),
    weights up to about ``magnitude``: uint8 [..., K / block * block bytes]."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    *lead, k = values.shape
    assert k % block == 0, f"{k} values per row do not fill {qtype.name} blocks of {block}"
    raw = RNG.integers(0, 256, size=(*lead, k // block, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        d = RNG.uniform(0.05, 1.0, size=raw.shape[:-1]) * magnitude / SPAN[qtype]
        raw[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(*lead, -1)


def dequant(t: dict[str, torch.Tensor], scheme: IntWeights, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_int(t["qweight"], t["scales"], None, t.get("mins"), scheme.bits, scheme.group_size,
                          scheme.default_zero, dtype)


def gguf_reference(raw: np.ndarray, qtype: QT) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype))


NATIVE = {  # type -> (scheme, scales' dtype)
    QT.Q4_K: (IntWeights(bits=4, group_size=32, zero_point=0, has_mins=True), torch.float32),
    QT.Q5_K: (IntWeights(bits=8, group_size=32, zero_point=0, has_mins=True), torch.float32),
    QT.Q6_K: (IntWeights(bits=8, group_size=16, zero_point=32), torch.float32),
    QT.Q5_0: (IntWeights(bits=8, group_size=32, zero_point=16), torch.float16),
    QT.Q5_1: (IntWeights(bits=8, group_size=32, zero_point=0, has_mins=True), torch.float16),
}


@pytest.mark.parametrize("qtype", list(NATIVE), ids=lambda q: q.name)
@pytest.mark.parametrize("magnitude", [1e-3, 30.0])  # fp16 d subnormal / large
def test_native_form_equals_gguf_dequantize(qtype, magnitude):
    raw = random_blocks(np.zeros((6, 768)), qtype, magnitude)
    form = native_form(qtype)
    assert (form.scheme, form.scale_dtype) == NATIVE[qtype]
    t = blocks_to_canonical(torch.from_numpy(raw), qtype)
    groups = 768 // form.scheme.group_size
    assert t["qweight"].shape == (6, 768 * form.scheme.bits // 32) and t["scales"].shape == (6, groups)
    assert t["scales"].dtype == form.scale_dtype and ("mins" in t) == form.scheme.has_mins
    want = gguf_reference(raw, qtype)
    assert torch.equal(dequant(t, form.scheme), want)
    assert torch.equal(dequant(t, form.scheme, torch.bfloat16), want.to(torch.bfloat16))  # rounded once, alike


@pytest.mark.parametrize("types, scheme", [
    ((QT.Q4_K, QT.Q6_K), IntWeights(bits=8, group_size=16, zero_point=0, has_mins=True)),  # Q4_K_M's q/k with v
    ((QT.Q5_K, QT.Q6_K), IntWeights(bits=8, group_size=16, zero_point=0, has_mins=True)),  # Q5_K_M's
    ((QT.Q4_K, QT.Q5_0, QT.Q8_0), IntWeights(bits=8, group_size=32, zero_point=0, has_mins=True)),  # row-length fallbacks
    ((QT.Q4_1, QT.Q4_K), IntWeights(bits=4, group_size=32, zero_point=0, has_mins=True)),  # one scheme, two dtypes
], ids=lambda v: "+".join(t.name for t in v) if isinstance(v, tuple) else "")
def test_common_form_equals_gguf_dequantize(types, scheme):
    form = common_form(set(types))
    assert form.scheme == scheme and form.scale_dtype == torch.float32
    for qtype in types:
        raw = random_blocks(np.zeros((4, 512)), qtype)
        t = blocks_to_canonical(torch.from_numpy(raw), qtype, form)
        assert t["scales"].dtype == t["mins"].dtype == torch.float32
        assert torch.equal(dequant(t, scheme), gguf_reference(raw, qtype)), qtype.name


def test_float_types_have_no_form():
    assert native_form(QT.F16) is None and common_form({QT.Q4_K, QT.F16}) is None
    assert common_form({QT.Q6_K}) == native_form(QT.Q6_K)
