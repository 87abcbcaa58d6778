"""GGUF reader: dequantization against scalar block references (and HF transformers'
dequantizer), quantize -> dequantize round trips, and an unsupported type refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import load_gguf
from tests.loading.gguf_blocks import REFERENCES, random_blocks
from tests.loading.gguf_fixtures import RNG, weights, write_gguf


@pytest.mark.parametrize("qtype", list(REFERENCES), ids=lambda q: q.name)
def test_dequantize_matches_block_reference(tmp_path: Path, qtype: QT) -> None:
    ref, f16_at = REFERENCES[qtype]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    rows, per_row = 3, 512 // block  # 3 rows of 512 values
    blocks = random_blocks(qtype, rows * per_row, f16_at)
    raw = blocks.reshape(rows, -1)
    ckpt = load_gguf(write_gguf(tmp_path / "q.gguf", tensors={"token_embd.weight": (raw, qtype)}))
    got = weights(ckpt)["model.embed_tokens.weight"]
    assert got.shape == (rows, 512) and got.dtype == torch.float32
    expect = torch.tensor([ref(b) for b in blocks], dtype=torch.float64).reshape(rows, 512)
    torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-6)
    # cross-check with HF transformers' own (torch) dequantizer where it is available
    try:
        from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    except ImportError:
        return
    hf = hf_dequantize(torch.from_numpy(raw.copy()), int(qtype)).reshape(rows, 512)
    torch.testing.assert_close(got, hf.float(), rtol=1e-5, atol=1e-6)


# relative RMS error bounds of a quantize -> dequantize round trip on N(0, 1) data
ROUND_TRIP = {QT.F32: 0.0, QT.F16: 5e-4, QT.BF16: 3e-3, QT.Q8_0: 0.008, QT.Q5_0: 0.06, QT.Q5_1: 0.06, QT.Q4_0: 0.12, QT.Q4_1: 0.12}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP), ids=lambda q: q.name)
def test_quantize_round_trip(tmp_path: Path, qtype: QT) -> None:
    data = RNG.standard_normal((6, 256)).astype(np.float32)
    packed = gguf.quants.quantize(data, qtype)
    tensor = packed if qtype in (QT.F32, QT.F16) else (packed, qtype)
    ckpt = load_gguf(write_gguf(tmp_path / "q.gguf", tensors={"output_norm.weight": data[0], "token_embd.weight": tensor}))
    got = weights(ckpt)
    emb = got["model.embed_tokens.weight"]
    assert emb.shape == (6, 256)
    err = (emb - torch.from_numpy(data)).pow(2).mean().sqrt().item()
    assert err <= ROUND_TRIP[qtype], f"{qtype.name}: rms error {err}"
    assert torch.equal(got["model.norm.weight"], torch.from_numpy(data[0]))
    # the requested dtype is honoured
    assert next(ckpt.weights(torch.bfloat16))[1].dtype == torch.bfloat16


def test_unsupported_quant_type_names_type_and_tensor(tmp_path: Path) -> None:
    raw = RNG.integers(0, 256, size=(2, gguf.GGML_QUANT_SIZES[QT.Q2_K][1]), dtype=np.uint8)
    path = write_gguf(tmp_path / "q2k.gguf", tensors={"token_embd.weight": (raw, QT.Q2_K)})
    with pytest.raises(CheckpointError, match=r"token_embd\.weight.*Q2_K"):
        load_gguf(path)
