"""DeepSeek-V2 / V3 served quantized: the engine holds the checkpoint's linear layers and routed
experts quantized, as on CUDA (``open_model(dequantize_on_load=False)``: the ``torch.ops.ingot``
references multiply them on CPU), ``kv_b_proj`` and the router dense.

Each tiny checkpoint (``deepseek_quant_fixtures``: compressed-tensors W4A16, GPTQ 4-bit, HF FP8
with block scales, online int8, GGUF Q4_0 / Q8_0 with both ``kv_b_proj`` layouts) gives, with its
layers quantized, the logits of the same checkpoint dequantized at load (the plain path, tested
against transformers in ``test_deepseek_hf`` / ``test_gguf_deepseek``): exactly for the int forms
(fp32: the references' math is the dense path's), and for FP8 exactly with its activations kept
(W8A16) and closely as served (W8A8 rounds each activation to fp8). Greedy tokens equal
transformers' on the checkpoint's weights dequantized independently of ingot: transformers' own
load of the compressed-tensors checkpoint, compressed-tensors' decompressor, the GPTQ and FP8
definitions, gguf-py's dequantize.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch
from gguf import GGMLQuantizationType as QT

import ingot.engine.engine as engine_mod
from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.layers.fused_moe import FusedMoE
from ingot.layers.linear import MergedLinear
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.errors import CheckpointError
from ingot.loading.quant_scheme import Fp8Weights, IntWeights
from ingot.models import loader
from ingot.models.deepseek import _take_rows
from ingot.models.deepseek_moe import DeepseekMoE
from tests.helpers import OpNames, ingot_logits
from tests.models.deepseek_quant_fixtures import (
    dense_sd,
    gguf_types,
    hf_reference,
    tiny_deepseek,
    write_quantized,
    write_quantized_gguf,
)

IDS = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(3)).tolist()
PROMPT, NEW = IDS[:10], 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
# GGUF's common form of Q4_0 with Q8_0 parts (q / q_a with kv_a; the experts' gate / up with down)
COMMON = IntWeights(bits=8, group_size=32, zero_point=0, has_mins=True)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_quant")
    return {arch: tiny_deepseek(root, arch) for arch in ("deepseek_v2", "deepseek_v3")}


def hold_quantized(monkeypatch) -> None:
    """Engines built from now on hold their layers quantized, as on CUDA."""
    monkeypatch.setattr(engine_mod, "open_model", functools.partial(loader.open_model, dequantize_on_load=False))


@dataclasses.dataclass
class Run:
    llm: LLM
    logits: torch.Tensor  # over IDS: prefill in chunks, then decode
    ops: set[str]  # the ops the logits' forwards ran
    tokens: list[int]  # greedy after PROMPT


def run(path: str, quantization: str | None = None, w8a16: bool = False) -> Run:
    """An fp32 CPU LLM over ``path`` and what it computes; ``w8a16``: fp8 layers with their
    activations kept in fp32."""
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, quantization=quantization)
    if w8a16:
        for m in llm.engine.executor.model.modules():
            if isinstance(m, (MergedLinear, FusedMoE)) and isinstance(m.scheme, Fp8Weights):
                m.scheme = dataclasses.replace(m.scheme, act_group=-1)
    with OpNames() as ran:
        logits = ingot_logits(llm.engine, IDS, prefill_len=14, chunk=5)
    tokens = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    return Run(llm, logits, ran.names, tokens)


def hf_greedy(model) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def check_held(model, scheme_type: type, ops: set[str] | None = None) -> None:
    """Every projection but kv_b_proj and the router quantized, those two in the model dtype; the
    quantized ops in ``ops``."""
    if ops is not None:
        kind = "fp8" if scheme_type is Fp8Weights else "int"
        assert {f"ingot.{kind}_linear", f"ingot.fused_moe_{kind}"} <= ops and "ingot.fused_moe" not in ops
    for layer in model.layers:
        attn = layer.self_attn
        projections = [attn.qkv_proj, attn.o_proj, *([attn.q_b_proj] if attn.q_b_proj is not None else [])]
        mlp = layer.mlp
        if isinstance(mlp, DeepseekMoE):
            projections += [mlp.shared_experts.gate_up_proj, mlp.shared_experts.down_proj]
            assert isinstance(mlp.experts.scheme, scheme_type) and mlp.gate.weight.dtype == torch.float32
            assert not hasattr(mlp.experts, "w_gate_up") or mlp.experts.w_gate_up.dtype == torch.float8_e4m3fn
        else:
            projections += [mlp.gate_up_proj, mlp.down_proj]
        assert all(isinstance(p.scheme, scheme_type) for p in projections)
        assert all(p.qweight.dtype == torch.int32 for p in projections if scheme_type is IntWeights)
        assert all(p.weight.dtype == torch.float8_e4m3fn for p in projections if scheme_type is Fp8Weights)
        assert attn.kv_b_proj.scheme is None and attn.kv_b_proj.weight.dtype == torch.float32


HF_CASES = [("compressed-tensors", "deepseek_v2"), ("compressed-tensors", "deepseek_v3"), ("gptq", "deepseek_v3"),
            ("fp8", "deepseek_v2"), ("fp8", "deepseek_v3"), ("online-int8", "deepseek_v2")]


@pytest.mark.parametrize("method,arch", HF_CASES)
def test_hf_checkpoint_served_quantized(hf_dirs, tmp_path, monkeypatch, method, arch):
    hf_dir = hf_dirs[arch]
    online = method == "online-int8"
    path = str(hf_dir if online else write_quantized(hf_dir, tmp_path / method, method))
    quantization = "int8" if online else None
    want = run(path, quantization)  # dequantized at load
    assert "ingot.fused_moe" in want.ops
    hold_quantized(monkeypatch)
    fp8 = method == "fp8"
    got = run(path, quantization, w8a16=fp8)
    check_held(got.llm.engine.executor.model, Fp8Weights if fp8 else IntWeights, got.ops)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert got.tokens == want.tokens
    if fp8:  # as served: every projection's input rounded to fp8 per 16 columns
        served = run(path).logits
        assert ((served - want.logits).norm() / want.logits.norm()).item() < 0.05
    if method == "compressed-tensors":  # transformers' own load of the checkpoint
        import transformers
        from transformers.utils.quantization_config import CompressedTensorsConfig

        with warnings.catch_warnings():  # "the quantization_config from the model will be used": as meant
            warnings.simplefilter("ignore", UserWarning)
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    elif not online:
        reference = hf_reference(hf_dir, dense_sd(hf_dir, method))
    else:
        return
    assert got.tokens == hf_greedy(reference)


@pytest.mark.parametrize("arch,split_kv_b", [("deepseek_v2", False), ("deepseek_v3", True)])
def test_gguf_served_quantized(hf_dirs, tmp_path, monkeypatch, arch, split_kv_b):
    """Q4_0 / Q8_0 tensors held in the int form (q or q_a with kv_a, and the experts, in their
    common form), kv_b_proj dequantized (whole ``attn_kv_b``, or joined from ``attn_k_b`` /
    ``attn_v_b``): the logits of the file dequantized at load, exactly."""
    hf_dir = hf_dirs[arch]
    path = str(write_quantized_gguf(hf_dir, tmp_path / "q.gguf", split_kv_b))
    want = run(path)  # dequantized at load
    hold_quantized(monkeypatch)
    got = run(path)
    model = got.llm.engine.executor.model
    check_held(model, IntWeights, got.ops)
    attn, moe = model.layers[1].self_attn, model.layers[1].mlp
    assert attn.qkv_proj.scheme == COMMON and moe.experts.scheme == COMMON
    assert attn.o_proj.scheme == IntWeights(bits=4, group_size=32, zero_point=8)
    assert attn.o_proj.scales.dtype == torch.float16  # GGUF's d as stored
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert got.tokens == want.tokens == hf_greedy(hf_reference(hf_dir, dense_sd(hf_dir, "gguf", split_kv_b)))


def test_gguf_projection_in_a_float_and_a_quantized_type_is_refused(hf_dirs, tmp_path):
    """q_a and kv_a are held as one projection: F16 with Q8_0 cannot share a form."""
    hf_dir = hf_dirs["deepseek_v3"]
    types = {**gguf_types(hf_dir, True), "blk.1.attn_q_a.weight": QT.F16}
    path = str(write_quantized_gguf(hf_dir, tmp_path / "mix.gguf", True, types))
    with pytest.raises(CheckpointError, match=r"'blk\.1\.attn_q_a\.weight' is F16 but 'blk\.1\.attn_kv_a_mqa\.weight' is "
                                              r"Q8_0: ingot holds layers\.1\.self_attn\.qkv_proj as one projection"):
        loader.open_model(EngineConfig(model=path, device="cpu"), dequantize_on_load=False)
    assert open_checkpoint(path).quant is None  # dequantized at load, it loads


def test_hf_shards_in_different_schemes_are_refused(hf_dirs, tmp_path):
    """q_a_proj quantized with kv_a_proj_with_mqa dense: one projection, two schemes."""
    hf_dir = hf_dirs["deepseek_v3"]
    path = write_quantized(hf_dir, tmp_path / "ct", "compressed-tensors", dense=("kv_a_proj_with_mqa",))
    ckpt = loader.open_model(EngineConfig(model=str(path), device="cpu"), dequantize_on_load=False)
    with pytest.raises(CheckpointError, match="q_a_proj, kv_a_proj_with_mqa are quantized differently"):
        loader.load_checkpoint(ckpt, torch.float32, torch.device("meta"), 64, progress=False)


def test_kv_b_proj_comes_dense_only_when_the_model_says_so(hf_dirs, tmp_path):
    """The model class names the modules it holds dense (``DENSE_MODULES``); the checkpoint opened
    without them hands kv_b_proj over quantized, which the model refuses by name."""
    path = str(write_quantized(hf_dirs["deepseek_v2"], tmp_path / "gptq", "gptq"))
    kv_b = "model.layers.0.self_attn.kv_b_proj"
    held = open_checkpoint(path, dequantize_on_load=False, held_dense=loader.held_dense)
    assert held.quant.scheme_for(kv_b) is None and held.quant.scheme_for("model.layers.0.self_attn.o_proj") is not None
    names = {name for name, _ in held.weights(torch.float32, None)}
    assert f"{kv_b}.weight" in names and f"{kv_b}.qweight" not in names and len(names) == held.num_tensors
    plain = open_checkpoint(path, dequantize_on_load=False)
    assert isinstance(plain.quant.scheme_for(kv_b), IntWeights)
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.kv_b_proj: the latent attention reads its weight"):
        loader.load_checkpoint(plain, torch.float32, torch.device("meta"), 64, progress=False)


def test_random_weights_quantized_hold_kv_b_proj_dense(hf_dirs):
    ckpt = loader.open_model(EngineConfig(model=str(hf_dirs["deepseek_v3"]), load_format="dummy", quantization="int8",
                                          device="cpu"), dequantize_on_load=False)
    model = loader.load_checkpoint(ckpt, torch.float32, torch.device("cpu"), 64, progress=False)
    check_held(model, IntWeights)


def test_rope_reorder_of_fp8_block_scales():
    """Rows reordered within their scale blocks (the last one partial) leave the scales as they are,
    as does one scale for the tensor; across blocks, refused. Weights and int parts follow the rows."""
    rows = torch.tensor([0, 1, 3, 2, 5, 4])
    scale = torch.arange(2.0)[:, None]
    assert _take_rows(scale, rows, "weight_scale", 4) is scale
    one = scale[:1]
    assert _take_rows(one, rows, "weight_scale", 1) is one
    assert torch.equal(_take_rows(torch.arange(6.0)[:, None], rows, "weight_scale", 1)[:, 0], rows.float())
    assert torch.equal(_take_rows(torch.arange(6)[:, None], rows, "qweight", 4)[:, 0], rows)
    with pytest.raises(ValueError, match="across the 3-row scale blocks of weight_scale"):
        _take_rows(scale, rows, "weight_scale", 3)
