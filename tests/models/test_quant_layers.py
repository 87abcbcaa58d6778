"""Quantized linear layers in the model: a checkpoint's canonical int / fp8 tensors held as
they load and multiplied by the int_linear / fp8_linear ops give the logits of the same model
with those weights dequantized into dense layers (fp32 on CPU: the references' math is the
dense path's, so the logits are equal)."""

from __future__ import annotations

import pytest
import torch

from ingot.layers.linear import MergedLinear
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.quant_scheme import Fp8Weights, IntWeights
from ingot.models.loader import load_checkpoint
from tests.helpers import write_tiny_checkpoint


WIDE = dict(hidden_size=128, intermediate_size=256)


def _logits(model, ids: list[int]) -> torch.Tensor:
    from ingot.layers.attention import AttentionMetadata
    from ingot.runner.kv_pool import KVCachePool

    cfg = model.config
    pool = KVCachePool(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache, attn.v_cache = pool.layer(i)
    n = len(ids)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(16, 16 + n), block_tables=torch.tensor([[1, 2, 3]], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", ["int4", "int8", "fp8"])
def test_quantized_layers_give_the_dequantized_models_logits(tmp_path, arch, quantization):
    # widths of multiples of 128: int4 quantizes groups of 128 input features
    path = str(write_tiny_checkpoint(tmp_path / arch, arch, overrides=WIDE))
    quantized = open_checkpoint(path, quantization=quantization, dequantize_on_load=False)
    dense = open_checkpoint(path, quantization=quantization, dequantize_on_load=True)
    assert quantized.quant is not None and dense.quant is None
    qmodel = load_checkpoint(quantized, torch.float32, torch.device("cpu"), 64, progress=False)
    dmodel = load_checkpoint(dense, torch.float32, torch.device("cpu"), 64, progress=False)
    layers = [m for m in qmodel.modules() if isinstance(m, MergedLinear) and m.scheme is not None]
    assert len(layers) == 4 * qmodel.config.num_layers  # qkv, o, gate_up, down of every layer
    want = Fp8Weights if quantization == "fp8" else IntWeights
    assert all(isinstance(m.scheme, want) and not hasattr(m, "weight") or m.weight.dtype == torch.float8_e4m3fn
               for m in layers)
    assert qmodel.lm_head.weight.dtype == torch.float32, "the lm_head stays dense"
    ids = [1, 5, 9, 33, 7, 12, 100, 2]
    got, want = _logits(qmodel, ids), _logits(dmodel, ids)
    if quantization != "fp8":
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:  # W8A8: the activations are rounded to fp8 too (3 mantissa bits), the dense model's are not
        assert ((got - want).norm() / want.norm()).item() < 0.05


def test_quantized_parameters_cost_their_bytes(tmp_path):
    path = str(write_tiny_checkpoint(tmp_path / "llama", "llama", overrides=WIDE))
    q = load_checkpoint(open_checkpoint(path, quantization="int4", dequantize_on_load=False), torch.float32,
                        torch.device("cpu"), 64, progress=False)
    proj = q.layers[0].mlp.down_proj
    assert proj.qweight.dtype == torch.int32 and proj.qweight.numel() * 4 == proj.in_features * sum(proj.local_sizes) // 2
    assert not hasattr(proj, "weight")


@pytest.mark.parametrize("weights, fmt", [
    (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32), "pack-quantized"),
    (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized"),
    (dict(num_bits=8, type="float", strategy="channel"), "float-quantized"),
])
def test_compressed_tensors_checkpoint_through_quantized_layers_matches_transformers(tmp_path, weights, fmt):
    """A checkpoint written by compressed-tensors, held quantized by ingot's layers (the reference
    ops on CPU, fp32 activations): exactly the logits of its weights dequantized at load, and
    transformers' own load of it (dequantized, fp32) up to its rounding of each weight to the
    checkpoint's bf16 scale dtype (ingot rounds once, to the model dtype)."""
    pytest.importorskip("compressed_tensors")
    import transformers

    from tests.loading.quant_fixtures import _dequantize_config, ct_checkpoint

    path = ct_checkpoint(tmp_path, weights, fmt)
    ckpt = open_checkpoint(str(path), dequantize_on_load=False)
    assert ckpt.quant is not None and ckpt.quant.method == "compressed-tensors"
    model = load_checkpoint(ckpt, torch.float32, torch.device("cpu"), 64, progress=False)
    assert all(m.scheme is not None for m in model.modules() if isinstance(m, MergedLinear) and m is not model.lm_head)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           quantization_config=_dequantize_config(path)).eval()
    dense = load_checkpoint(open_checkpoint(str(path)), torch.float32, torch.device("cpu"), 64, progress=False)
    ids = [1, 5, 9, 33, 7, 12, 100, 2]
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    got = _logits(model, ids)
    torch.testing.assert_close(got, _logits(dense, ids), rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=5e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_scales_take_the_checkpoint_dtype_on_the_layers_device():
    """A float16 scale tensor re-types ``scales`` where the layer lives (the model is built on
    the GPU there; 'meta' stands for any device but the CPU here), still a parameter."""
    from ingot.layers import quant_linear

    with torch.device("meta"):
        proj = MergedLinear(128, (64,), scheme=IntWeights(bits=4, group_size=32))
    quant_linear.adopt_dtype(proj, "scales", torch.float16)
    assert isinstance(proj.scales, torch.nn.Parameter)
    assert proj.scales.dtype == torch.float16 and proj.scales.device.type == "meta" and proj.scales.shape == (64, 4)
