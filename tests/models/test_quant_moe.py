"""Routed experts held quantized (FusedMoE with a scheme, the fused_moe_int / fused_moe_fp8 ops).

A tiny MoE checkpoint quantized online, or a GGUF whose experts are Q4_0 / Q4_1 / Q8_0, loaded
with its experts quantized gives exactly the logits of the same weights dequantized at load
(fp32 on CPU: the references' math is the dense path's); fp8 W8A8 also rounds activations, so
it is compared once with its activations kept (W8A16, exact) and once as served (close).
Tensor-parallel slices of quantized experts add up to the whole layer; GGUF experts in several
types are held in one form; mixed schemes, groups a rank's features straddle and act-order
experts are refused clearly; random weights
(``load_format="dummy"``) quantize the experts too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ingot.distributed.parallel import TensorParallel
from ingot.layers.fused_moe import FusedMoE
from ingot.layers.linear import MergedLinear
from ingot.layers.policy import OpPolicy
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.errors import CheckpointError
from ingot.loading.quant_scheme import Fp8Weights, IntWeights
from ingot.models.loader import load_checkpoint
from tests.helpers import write_tiny_checkpoint
from tests.models.test_quant_layers import _logits

# widths of multiples of 128: int4 quantizes groups of 128 input features
WIDE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128)
IDS = [1, 5, 9, 33, 7, 12, 100, 2]


def load(ckpt):
    return load_checkpoint(ckpt, torch.float32, torch.device("cpu"), 64, progress=False)


def experts(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def keep_activations(model) -> None:
    """fp8 layers as W8A16 (activations in the model dtype): the quantized model's math is then the dense one's."""
    for m in model.modules():
        if isinstance(m, (MergedLinear, FusedMoE)) and isinstance(m.scheme, Fp8Weights):
            m.scheme = dataclasses.replace(m.scheme, act_group=-1)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_moe")
    return {arch: str(write_tiny_checkpoint(root / arch, arch, overrides=WIDE)) for arch in ("qwen3_moe", "qwen2_moe")}


@pytest.mark.parametrize("arch,quantization", [("qwen3_moe", "int4"), ("qwen3_moe", "int8"), ("qwen3_moe", "fp8"),
                                               ("qwen2_moe", "int4")])
def test_quantized_experts_give_the_dequantized_models_logits(tiny_moe, arch, quantization):
    path = tiny_moe[arch]
    qmodel = load(open_checkpoint(path, quantization=quantization, dequantize_on_load=False))
    dmodel = load(open_checkpoint(path, quantization=quantization, dequantize_on_load=True))
    want = Fp8Weights if quantization == "fp8" else IntWeights
    layers = experts(qmodel)
    assert layers and all(isinstance(m.scheme, want) for m in layers)
    assert all(m.scheme is None for m in experts(dmodel))
    if quantization == "fp8":
        served = _logits(qmodel, IDS)
        keep_activations(qmodel)
        torch.testing.assert_close(_logits(qmodel, IDS), _logits(dmodel, IDS), rtol=0, atol=0)
        assert ((served - _logits(dmodel, IDS)).norm() / _logits(dmodel, IDS).norm()).item() < 0.1
    else:
        torch.testing.assert_close(_logits(qmodel, IDS), _logits(dmodel, IDS), rtol=0, atol=0)


def test_quantized_experts_cost_their_bytes_and_take_the_row_scale(tiny_moe):
    """int4 experts hold their packed codes and scales, no dense copy; on the skinny path (the norm
    in the router's GEMV) they take its row scale."""
    model = load(open_checkpoint(tiny_moe["qwen3_moe"], quantization="int4", dequantize_on_load=False))
    moe = experts(model)[0]
    names = {n for n, _ in moe.named_parameters()}
    assert names == {"w_gate_up_qweight", "w_gate_up_scales", "w_down_qweight", "w_down_scales"}
    assert moe.w_gate_up_qweight.shape == (8, 2 * 128, 128 // 8) and moe.w_down_scales.shape == (8, 128, 1)
    calls = []
    moe.register_forward_hook(lambda mod, args, out: calls.append(args[3] if len(args) > 3 else None))
    from ingot.layers.attention import AttentionMetadata
    from ingot.runner.kv_pool import KVCachePool

    cfg = model.config
    pool = KVCachePool(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache, attn.v_cache = pool.layer(i)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(16, 17), block_tables=torch.tensor([[1]], dtype=torch.int32),
                             seq_lens=torch.tensor([1], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32))
    with torch.inference_mode():
        plain = model(torch.tensor([5]), torch.arange(1), meta)
        skinny = model(torch.tensor([5]), torch.arange(1), meta, OpPolicy(skinny_rows=1))
    assert calls[0] is None and calls[-1] is not None  # the rstd handed to the experts
    torch.testing.assert_close(skinny, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_1"])
def test_gguf_quantized_experts_load_quantized(tmp_path, qtype):
    from gguf import GGMLQuantizationType as QT

    from tests.loading.test_gguf_moe import write_moe_gguf

    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "qwen3_moe")
    types = {f"blk.{layer}.ffn_{p}_exps.weight": QT[qtype] for layer in (0, 2) for p in ("gate", "up", "down")}
    path = str(write_moe_gguf(hf_dir, tmp_path / "moe.gguf", "qwen3_moe", types))
    model = load(open_checkpoint(path, dequantize_on_load=False))
    scheme = experts(model)[0].scheme
    assert isinstance(scheme, IntWeights) and scheme.group_size == 32 and scheme.has_mins == (qtype == "Q4_1")
    assert experts(model)[0].w_gate_up_scales.dtype == torch.float16  # GGUF's scales as stored
    torch.testing.assert_close(_logits(model, IDS), _logits(load(open_checkpoint(path)), IDS), rtol=0, atol=0)


def test_gguf_experts_in_several_types_are_held_in_one_form(tmp_path):
    """Q4_0 gate/up with Q8_0 down: every expert projection restated exactly as int8, zero points
    folded into fp32 mins; a float part among them is refused, naming the tensors and types."""
    from gguf import GGMLQuantizationType as QT

    from tests.loading.test_gguf_moe import write_moe_gguf

    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "qwen3_moe")
    types = {f"blk.{layer}.ffn_{p}_exps.weight": QT.Q8_0 if p == "down" else QT.Q4_0 for layer in (0, 2)
             for p in ("gate", "up", "down")}
    path = str(write_moe_gguf(hf_dir, tmp_path / "moe.gguf", "qwen3_moe", types))
    model = load(open_checkpoint(path, dequantize_on_load=False))
    assert experts(model)[0].scheme == IntWeights(bits=8, group_size=32, zero_point=0, has_mins=True)
    assert experts(model)[0].w_down_mins.dtype == torch.float32
    torch.testing.assert_close(_logits(model, IDS), _logits(load(open_checkpoint(path)), IDS), rtol=0, atol=0)
    bad = write_moe_gguf(hf_dir, tmp_path / "bad.gguf", "qwen3_moe", {**types, "blk.0.ffn_down_exps.weight": QT.F16})
    with pytest.raises(CheckpointError, match=r"'blk\.0\.ffn_down_exps\.weight' is F16 but 'blk\.0\.ffn_gate_exps\.weight' "
                                              r"is Q4_0: ingot holds layers\.0\.mlp\.experts as one projection"):
        open_checkpoint(str(bad), dequantize_on_load=False)


# (scheme, canonical parts of one [n, k] weight)
def canonical(scheme, n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from ingot.loading.quant_online import quantize_weight

    w = torch.randn(n, k, generator=gen) / k**0.5
    if isinstance(scheme, Fp8Weights) and scheme.block_n:  # blocks: per-tensor quantization, scales repeated
        parts = quantize_weight(w, Fp8Weights())
        grid = scheme.grid(n, k)
        return {"weight": parts["weight"], "weight_scale": parts["weight_scale"].expand(*grid).contiguous()}
    parts = quantize_weight(w, scheme if not isinstance(scheme, IntWeights) or scheme.group_size else
                            dataclasses.replace(scheme, group_size=k))
    if isinstance(scheme, IntWeights) and scheme.has_zeros:
        parts["zeros"] = torch.full(parts["scales"].shape, scheme.default_zero, dtype=torch.uint8)
    return parts


@pytest.mark.parametrize("scheme", [IntWeights(4, 32, has_zeros=True), IntWeights(8, 0), Fp8Weights(0, 0, -1),
                                    Fp8Weights(32, 32, 32)], ids=["int4-g32-zeros", "int8-row", "fp8-tensor", "fp8-blocks"])
def test_tensor_parallel_slices_add_up_to_the_layer(scheme):
    """Each rank loads its slice of every expert's canonical tensors (``checkpoint_slice``); the
    ranks' partial outputs add up to the whole layer's."""
    e, h, i, gen = 4, 64, 128, torch.Generator().manual_seed(0)
    tensors = {(x, p): canonical(scheme, *(i, h) if p != "down_proj" else (h, i), gen)
               for x in range(e) for p in ("gate_proj", "up_proj", "down_proj")}

    def build(tp):
        moe = FusedMoE(e, h, i, tp, scheme)
        filled = set()
        for (x, proj), parts in tensors.items():
            for part, t in parts.items():
                index = moe.checkpoint_slice(proj, x, part)
                filled.update(moe.load(proj, x, t if index is None else t[index], part))
        assert filled == moe.expected_keys()
        return moe

    hidden = torch.randn(5, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    whole = build(TensorParallel())(hidden, weights, ids)
    parts = sum(build(TensorParallel(rank, 2))(hidden, weights, ids) for rank in range(2))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_refusals():
    with pytest.raises(ValueError, match="do not align with the 64-wide groups"):
        FusedMoE(4, 64, 96, TensorParallel(1, 2), IntWeights(4, 64))
    with pytest.raises(ValueError, match="scale blocks"):
        FusedMoE(4, 64, 192, TensorParallel(1, 2), Fp8Weights(128, 128, 128))
    moe = FusedMoE(4, 64, 32, scheme=IntWeights(4, 32, act_order=True))
    assert moe.load("gate_proj", 0, torch.arange(64), "perm") == []  # the identity: nothing to do
    with pytest.raises(ValueError, match="act-order"):
        moe.load("gate_proj", 0, torch.arange(64).flip(0), "perm")
    with pytest.raises(ValueError, match="stacked or fused"):
        moe.load("gate_proj", None, torch.zeros(4, 32, 8, dtype=torch.int32), "qweight")
    with pytest.raises(ValueError, match="not a parameter"):
        moe.load("gate_proj", 0, torch.zeros(32, 1, dtype=torch.uint8), "zeros")


@pytest.mark.parametrize("quantization", ["int4", "int8", "fp8"])
def test_random_weights_quantize_the_experts(tiny_moe, quantization):
    model = load(open_checkpoint(tiny_moe["qwen3_moe"], load_format="dummy", quantization=quantization))
    moe = experts(model)[0]
    if quantization == "fp8":
        assert isinstance(moe.scheme, Fp8Weights) and moe.w_gate_up.dtype == torch.float8_e4m3fn
    else:
        assert isinstance(moe.scheme, IntWeights) and moe.w_gate_up_qweight.dtype == torch.int32
    assert all(torch.isfinite(p.float()).all() for p in moe.parameters())
    assert torch.isfinite(_logits(model, IDS)).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", ["int4", "int8", "fp8"])
def test_cuda_engine_runs_the_quantized_expert_kernels(tiny_moe, monkeypatch, quantization):
    """An fp32 engine on CUDA (Triton kernels; decode on the skinny path, the router's row scale
    handed to the experts) against the same quantized model on CPU (the references): prefill in
    chunks (grouped path) and decode (per pair) within the GPU's TF32 attention noise."""
    import ingot.engine.engine as engine_mod
    from ingot.config import EngineConfig
    from ingot.engine.engine import Engine
    from tests.helpers import OpNames, ingot_logits

    path = tiny_moe["qwen3_moe"]
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    config = dict(model=path, quantization=quantization, dtype="float32", eager_mode=True, show_progress=False)
    with OpNames() as ran:
        got = ingot_logits(Engine(EngineConfig(device="cuda", gpu_memory_utilization=0.2, **config)), ids, 20, 7)
    assert f"ingot.fused_moe_{'fp8' if quantization == 'fp8' else 'int'}" in ran.names
    monkeypatch.setattr(engine_mod, "open_model", lambda c: open_checkpoint(
        c.model, c.tokenizer, c.load_format, c.quantization, dequantize_on_load=False))
    want = ingot_logits(Engine(EngineConfig(device="cpu", **config)), ids, 20, 7)
    # W8A8 fp8 rounds every activation to 3 mantissa bits: noise of 5e-4 (the GPU's TF32
    # attention) at those roundings moves the CPU references' logits by 3.9% on this model
    # (the engine's own GPU run: 3.4%); a wrong scale or expert moves them by O(1)
    assert (got - want).norm() / want.norm() < (6e-2 if quantization == "fp8" else 2e-3)
    if quantization != "fp8":  # W8A8: a flipped fp8 rounding may move a near tie
        assert torch.equal(got.argmax(-1), want.argmax(-1))
