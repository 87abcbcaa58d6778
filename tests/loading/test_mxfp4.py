"""MXFP4 experts (gpt-oss): the conversion to fp8 + fp32 block scales against a dequantization
written here from the format's definition (OCP Microscaling: e2m1 elements, e8m0 scales), and a
tiny MXFP4 checkpoint against its dequantized dense twin, dequantized at load and held as fp8."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.layers.fused_moe import FusedMoE
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.errors import CheckpointError
from ingot.loading.mxfp4 import mxfp4_to_fp8
from ingot.loading.quant_scheme import Fp8Weights
from ingot.models import loader
from tests.helpers import ingot_logits
from tests.models.gpt_oss_cases import write_gpt_oss


def e2m1(code: int) -> float:
    """An e2m1 element: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0; exponent 0 subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., N, G, 16] bytes (element 2j in the low nibble of byte j) and e8m0 scales [..., N, G]
    -> fp64 [..., N, G * 32]: element times 2 ** (scale - 127)."""
    table = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    b = blocks.long()
    elements = torch.stack((table[b & 15], table[b >> 4]), dim=-1).flatten(-2)  # [..., N, G, 32]
    return (elements * torch.pow(2.0, scales.double() - 127)[..., None]).flatten(-2)


def random_mxfp4(shape: tuple[int, ...], gen: torch.Generator, lo: int = 118, hi: int = 124):
    """Blocks and scales of a [..., N, K] weight (scales 2 ** (lo - 127) .. 2 ** (hi - 128))."""
    *lead, n, k = shape
    blocks = torch.randint(0, 256, (*lead, n, k // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, torch.randint(lo, hi, (*lead, n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)


def test_conversion_is_exact():
    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4((3, 8, 96), gen, 0, 255)  # every code, scales 2 ** -127 .. 2 ** 127
    w, s = mxfp4_to_fp8(blocks, scales)
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and w.shape == (3, 8, 96) and s.shape == (3, 8, 3)
    got = w.double() * s.double().repeat_interleave(32, dim=-1)
    assert torch.equal(got, dequantize(blocks, scales))
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # HF's reading agrees

    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    assert torch.equal(hf.transpose(1, 2).double(), dequantize(blocks, scales).float().double())


def test_bad_blocks_are_refused():
    with pytest.raises(CheckpointError, match="do not match scales"):
        mxfp4_to_fp8(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """(MXFP4 checkpoint, its dense twin): random MXFP4 experts in a tiny gpt-oss checkpoint, and the
    same model with those experts dequantized into transformers' dense layout."""
    root = tmp_path_factory.mktemp("mxfp4")
    dense = write_gpt_oss(root / "dense", seed=2)
    (file,) = dense.glob("*.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(3)
    packed = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors[name].shape  # transformers' [E, in, out]
        blocks, scales = random_mxfp4((e, n, k), gen)
        tensors[name] = dequantize(blocks, scales).float().transpose(1, 2).contiguous()
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    save_file(tensors, file, metadata={"format": "pt"})
    quant = root / "mxfp4"
    shutil.copytree(dense, quant)
    (quant / file.name).unlink()
    save_file(packed, quant / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quant / "config.json").write_text(json.dumps(config))
    return quant, dense


def _logits(path) -> torch.Tensor:
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    ids = torch.randint(3, 380, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    return ingot_logits(engine, ids, prefill_len=14, chunk=5)


def test_checkpoint_matches_its_dense_twin(twins, monkeypatch):
    quant, dense = twins
    want = _logits(dense)
    assert torch.equal(_logits(quant), want)  # dequantized at load (CPU): the same weights
    opened = open_checkpoint(str(quant), dequantize_on_load=False)
    assert opened.quant is not None and opened.quant.scheme == Fp8Weights(1, 32)
    real = loader.open_checkpoint
    monkeypatch.setattr(loader, "open_checkpoint", lambda *a, **kw: real(*a, **{**kw, "dequantize_on_load": False}))
    engine = Engine(EngineConfig(model=str(quant), dtype="float32", device="cpu", show_progress=False))
    experts = engine.executor.model.layers[0].mlp.experts
    assert isinstance(experts, FusedMoE) and experts.w_gate_up.dtype == torch.float8_e4m3fn
    ids = torch.randint(3, 380, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    got = ingot_logits(engine, ids, prefill_len=14, chunk=5)  # held as fp8: fused_moe_fp8
    assert (got - want).norm() / want.norm() < 1e-6


def test_unknown_config_field_is_named(twins, tmp_path):
    quant, _ = twins
    bad = tmp_path / "bad"
    shutil.copytree(quant, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["swizzle_mode"] = "hopper"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="swizzle_mode"):
        open_checkpoint(str(bad))
