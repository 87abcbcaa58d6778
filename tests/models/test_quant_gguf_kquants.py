"""GGUF K-quant models served quantized give the logits of the same file dequantized at load.

Tiny random Llama / Qwen2 / Qwen3-MoE checkpoints (widths of 256: a K-quant super-block) written
as GGUFs whose projections are random K-quant blocks (tests/loading/test_gguf_kquants.py), one
type throughout or mixed the way llama.cpp's Q4_K_M / Q5_K_M mix them (attn_v and ffn_down in
Q6_K in some layers), and loaded with ``dequantize_on_load=False``: fp32 on CPU, the int_linear /
fused_moe_int references compute what the dense path does from the same weights, so the logits
are equal.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ingot.layers.fused_moe import FusedMoE
from ingot.layers.linear import MergedLinear
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.quant_scheme import IntWeights
from ingot.models.loader import load_checkpoint
from tests.helpers import write_tiny_checkpoint
from tests.loading.test_gguf_kquants import random_blocks
from tests.loading.test_gguf_moe import write_moe_gguf
from tests.models.test_quant_layers import _logits

WIDE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256)
IDS = [1, 5, 9, 33, 7, 12, 100, 2]
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
COMMON_16 = IntWeights(bits=8, group_size=16, zero_point=0, has_mins=True)  # K-quant shards with Q6_K ones


def k_mix(base: QT, layers: int, more_bits: tuple[int, ...], names: tuple[str, ...] = PROJECTIONS) -> dict[str, QT]:
    """llama.cpp's Q4_K_M / Q5_K_M: every projection ``base``, attn_v and ffn_down Q6_K in ``more_bits``."""
    return {f"blk.{i}.{p}.weight": QT.Q6_K if i in more_bits and p in ("attn_v", "ffn_down", "ffn_down_exps") else base
            for i in range(layers) for p in names}


def load(path: str, quantized: bool):
    ckpt = open_checkpoint(path, dequantize_on_load=not quantized)
    return load_checkpoint(ckpt, torch.float32, torch.device("cpu"), 64, progress=False)


def qkv(model, layer: int) -> MergedLinear:
    return model.layers[layer].self_attn.qkv_proj


@pytest.mark.parametrize("arch, types", [
    ("llama", k_mix(QT.Q6_K, 2, ())),
    ("llama", k_mix(QT.Q4_K, 2, (0,))),  # Q4_K_M: layer 1 all Q4_K, layer 0's q/k/v in the common form
    ("qwen2", k_mix(QT.Q5_K, 2, (1,))),  # Q5_K_M: layer 0 all Q5_K
], ids=["Q6_K", "Q4_K_M", "Q5_K_M"])
def test_kquant_model_logits_equal_dequantized(tmp_path, arch, types):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", arch, overrides=WIDE)
    path = str(write_moe_gguf(hf_dir, tmp_path / "k.gguf", arch, types, blocks=random_blocks))
    qmodel, dmodel = load(path, True), load(path, False)
    for layer in range(2):
        shards = {types[f"blk.{layer}.attn_{p}.weight"] for p in "qkv"}
        scheme = qkv(qmodel, layer).scheme
        assert scheme == (COMMON_16 if len(shards) > 1 else
                          {QT.Q4_K: IntWeights(4, 32, 0, has_mins=True), QT.Q5_K: IntWeights(8, 32, 0, has_mins=True),
                           QT.Q6_K: IntWeights(8, 16, 32)}[shards.pop()])
        assert qkv(qmodel, layer).scales.dtype == torch.float32 and qkv(dmodel, layer).scheme is None
    torch.testing.assert_close(_logits(qmodel, IDS), _logits(dmodel, IDS), rtol=0, atol=0)


def test_kquant_moe_experts_logits_equal_dequantized(tmp_path):
    """Qwen3-MoE, Q4_K_M-like: layer 0's experts Q4_K gate/up with Q6_K down (one int8 group-16
    form for the layer), layer 2's all Q4_K; attention Q4_K with Q6_K v in layer 0."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", overrides={**WIDE, "head_dim": 64})
    names = (*PROJECTIONS[:4], "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    types = {name: qtype for name, qtype in k_mix(QT.Q4_K, 3, (0,), names).items() if not name.startswith("blk.1.ffn")}
    types |= {f"blk.1.{p}.weight": QT.Q4_K for p in ("ffn_gate", "ffn_up", "ffn_down")}  # the dense layer
    path = str(write_moe_gguf(hf_dir, tmp_path / "moe.gguf", "qwen3_moe", types, blocks=random_blocks))
    qmodel, dmodel = load(path, True), load(path, False)
    moe = [m for m in qmodel.modules() if isinstance(m, FusedMoE)]
    assert [m.scheme for m in moe] == [COMMON_16, IntWeights(4, 32, 0, has_mins=True)]
    assert moe[0].w_down_scales.dtype == moe[1].w_gate_up_mins.dtype == torch.float32
    torch.testing.assert_close(_logits(qmodel, IDS), _logits(dmodel, IDS), rtol=0, atol=0)
