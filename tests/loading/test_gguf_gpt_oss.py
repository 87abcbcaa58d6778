"""GGUFs of gpt-oss (llama.cpp's ``gpt-oss``) written from tiny HF checkpoints, against HF transformers.

The writer follows llama.cpp's converter (``GptOssModel``): sinks as ``attn_sinks.weight``, the
pre-MLP norm as ``post_attention_norm``, the router as ``ffn_gate_inp`` (weight and bias), the
experts' transformers layout ``gate_up_proj [E, H, 2I]`` (gate at even, up at odd columns)
transposed and split into ``ffn_gate_exps`` / ``ffn_up_exps`` (or, with ``--fuse-gate-up-exps``,
one ``ffn_gate_up_exps`` of gate rows then up rows) with their biases, ``down_proj`` transposed;
MXFP4 experts repacked into ggml's blocks (the exponent byte first, value j in the low and
value j + 16 in the high nibble of byte j). llama.cpp fixes the clamped SwiGLU's limit at 7,
so the checkpoints here use it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.layers.fused_moe import FusedMoE
from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import load_gguf
from ingot.loading.quant_pack import dequantize_fp8
from ingot.loading.quant_scheme import Fp8Weights
from ingot.models import loader
from tests.helpers import hf_logits, hf_model, ingot_logits
from tests.loading.gguf_fixtures import TO_GGUF, write_gguf
from tests.loading.test_gguf_moe import hf_state_dict
from tests.models.gpt_oss_cases import write_gpt_oss

GPT_OSS_TO_GGUF = {**TO_GGUF, "post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks",
                   "mlp.router": "ffn_gate_inp"}
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
IDS = torch.randint(3, 380, (30,), generator=torch.Generator().manual_seed(4)).tolist()


def gguf_name(name: str) -> str:
    if name.endswith(".sinks"):
        name += ".weight"  # the converter's rename
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{GPT_OSS_TO_GGUF[rest]}.{kind}"
    return f"{GPT_OSS_TO_GGUF[stem]}.{kind}"


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """HF MXFP4 blocks [..., N, K / 32, 16] (values 2j, 2j + 1 in byte j) and e8m0 scales [..., N, K / 32]
    -> ggml's MXFP4 bytes [..., N, K / 32 * 17]: the scale byte, then value j low and j + 16 high in byte j."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., 32] in column order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).flatten(-2).numpy()


def gpt_oss_tensors(hf_dir: Path, fuse_gate_up: bool = False) -> dict:
    """llama.cpp's converter over a checkpoint's tensors (dense or MXFP4 experts)."""
    sd = hf_state_dict(hf_dir)
    out: dict = {}
    for name, t in sd.items():
        m = _EXPERTS.match(name)
        if m is None:
            out[gguf_name(name)] = t.float().numpy()
            continue
        layer, proj, suffix = m.groups()
        if suffix == "_scales":
            continue  # with its blocks
        if suffix == "_blocks":  # [E, out, K / 32, 16]: rows are dim 1
            scales = sd[name.replace("_blocks", "_scales")]
            pick = lambda rows: (ggml_mxfp4(t[:, rows], scales[:, rows]), QT.MXFP4)  # noqa: E731
        else:  # a bias [E, out], or a dense weight [E, in, out] made [E, out, in]
            value = t.float() if suffix == "_bias" else t.float().transpose(1, 2)
            pick = lambda rows: value[:, rows].numpy()  # noqa: E731
        kind = "bias" if suffix == "_bias" else "weight"
        if proj == "down_proj":
            out[f"blk.{layer}.ffn_down_exps.{kind}"] = pick(slice(None))
            continue
        gate, up = pick(slice(0, None, 2)), pick(slice(1, None, 2))  # transformers interleaves gate and up
        if not fuse_gate_up:
            out[f"blk.{layer}.ffn_gate_exps.{kind}"], out[f"blk.{layer}.ffn_up_exps.{kind}"] = gate, up
        elif isinstance(gate, tuple):
            out[f"blk.{layer}.ffn_gate_up_exps.{kind}"] = (np.concatenate((gate[0], up[0]), axis=1), QT.MXFP4)
        else:
            out[f"blk.{layer}.ffn_gate_up_exps.{kind}"] = np.concatenate((gate, up), axis=1)
    return out


def write_gpt_oss_gguf(hf_dir: Path, out: Path, fuse_gate_up: bool = False, skip: tuple[str, ...] = (),
                       pattern: list[bool] | None = None, replace: dict | None = None) -> Path:
    """The GGUF of a gpt-oss checkpoint: gate/up experts as one tensor with ``fuse_gate_up``, metadata
    keys (without the ``gpt-oss.`` prefix) in ``skip`` left out, ``pattern`` as its sliding_window_pattern,
    the tensors in ``replace`` replaced."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    ints = {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "expert_count": cfg["num_local_experts"], "expert_used_count": cfg["num_experts_per_tok"],
        "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
        "attention.sliding_window": cfg["sliding_window"], "expert_feed_forward_length": cfg["intermediate_size"],
    }
    floats = {"rope.freq_base": rope["rope_theta"], "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
              "rope.scaling.factor": rope["factor"], "rope.scaling.yarn_beta_fast": rope["beta_fast"],
              "rope.scaling.yarn_beta_slow": rope["beta_slow"]}

    def meta(w: gguf.GGUFWriter) -> None:
        for key, value in ints.items():
            if key not in skip:
                w.add_uint32(f"gpt-oss.{key}", value)
        for key, value in floats.items():
            w.add_float32(f"gpt-oss.{key}", value)
        w.add_string("gpt-oss.rope.scaling.type", "yarn")
        if pattern is not None:
            w.add_array("gpt-oss.attention.sliding_window_pattern", pattern)

    tensors = {**gpt_oss_tensors(hf_dir, fuse_gate_up), **(replace or {})}
    return write_gguf(out, "gpt-oss", tensors=tensors, meta=meta, hparams=False)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), seed=1, swiglu_limit=7.0)


def engine_logits(path: Path) -> torch.Tensor:
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    return ingot_logits(engine, IDS, prefill_len=22, chunk=7)  # chunks cross the 8-token window; then decode


def assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert (got - ref).norm() / ref.norm() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("fuse_gate_up", [False, True], ids=["gate_up_split", "gate_up_fused"])
def test_logits_and_greedy_tokens_match_hf(dense, tmp_path, fuse_gate_up):
    path = write_gpt_oss_gguf(dense, tmp_path / "m.gguf", fuse_gate_up)
    cfg = load_gguf(path).config
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["layer_types"] == json.loads(
        (dense / "config.json").read_text())["layer_types"]
    assert cfg["rope_scaling"]["truncate"] is False and cfg["swiglu_limit"] == 7.0
    assert_matches(engine_logits(path), hf_logits(dense, IDS))
    if fuse_gate_up:
        return
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False)
    out = llm.generate([IDS[:21]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        full = hf_model(dense).generate(torch.tensor([IDS[:21]]), max_new_tokens=16, min_new_tokens=16,
                                        do_sample=False, pad_token_id=0)
    assert out[0].outputs[0].token_ids == full[0, 21:].tolist()


@pytest.fixture(scope="module")
def mxfp4_twins(tmp_path_factory):
    """(MXFP4 HF checkpoint, its dense twin), as test_mxfp4 builds them, with llama.cpp's SwiGLU limit."""
    from safetensors.torch import save_file

    from tests.loading.test_mxfp4 import dequantize, random_mxfp4

    root = tmp_path_factory.mktemp("mxfp4")
    dense_dir = write_gpt_oss(root / "dense", seed=2, swiglu_limit=7.0)
    (file,) = dense_dir.glob("*.safetensors")
    tensors = hf_state_dict(dense_dir)
    packed = dict(tensors)
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors[name].shape
        blocks, scales = random_mxfp4((e, n, k), gen)
        tensors[name] = dequantize(blocks, scales).float().transpose(1, 2).contiguous()
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    save_file(tensors, file, metadata={"format": "pt"})
    quant = root / "mxfp4"
    quant.mkdir()
    save_file(packed, quant / "model.safetensors", metadata={"format": "pt"})
    (quant / "config.json").write_text((dense_dir / "config.json").read_text())
    return quant, dense_dir


@pytest.mark.parametrize("fuse_gate_up", [False, True], ids=["gate_up_split", "gate_up_fused"])
def test_mxfp4_experts(mxfp4_twins, tmp_path, monkeypatch, fuse_gate_up):
    """MXFP4 expert tensors: gguf-py's dequantize of the file's blocks is the dense twin's experts
    (the writer lays ggml's blocks out right); ingot's logits, dequantized at load (CPU) and held as
    fp8 (as on CUDA), equal transformers' on the dense twin."""
    quant, dense_dir = mxfp4_twins
    path = write_gpt_oss_gguf(quant, tmp_path / "mxfp4.gguf", fuse_gate_up)
    sd = hf_state_dict(dense_dir)
    down = sd["model.layers.1.mlp.experts.down_proj"].transpose(1, 2)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.1.ffn_down_exps.weight"]
    assert stored.tensor_type == QT.MXFP4
    assert torch.equal(torch.from_numpy(gguf.quants.dequantize(stored.data, QT.MXFP4).copy()), down)

    g = load_gguf(path)
    canon = dict(g.weights(torch.float32, dequantize=False))
    assert g.quant.scheme_for("model.layers.1.mlp.experts.2.up_proj") == Fp8Weights(1, 32)
    up = sd["model.layers.1.mlp.experts.gate_up_proj"].transpose(1, 2)[2, 1::2]
    module = "model.layers.1.mlp.experts.2.up_proj"
    part = {"weight": canon[f"{module}.weight"], "weight_scale": canon[f"{module}.weight_scale"]}
    assert torch.equal(dequantize_fp8(part, Fp8Weights(1, 32), torch.float32), up)

    ref = hf_logits(dense_dir, IDS)
    assert_matches(engine_logits(path), ref)  # dequantized at load
    real = loader.open_checkpoint
    monkeypatch.setattr(loader, "open_checkpoint", lambda *a, **kw: real(*a, **{**kw, "dequantize_on_load": False}))
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    experts = engine.executor.model.layers[0].mlp.experts
    assert isinstance(experts, FusedMoE) and experts.w_gate_up.dtype == torch.float8_e4m3fn
    assert_matches(ingot_logits(engine, IDS, prefill_len=22, chunk=7), ref)  # held as fp8: fused_moe_fp8


def test_mxfp4_with_another_type_in_one_layer(mxfp4_twins, tmp_path):
    """A layer's experts held as one: MXFP4 gate/up with Q8_0 down cannot share a form, so serving
    them quantized is refused by name; dequantized at load they are read as stored."""
    quant, dense_dir = mxfp4_twins
    down = hf_state_dict(dense_dir)["model.layers.0.mlp.experts.down_proj"].transpose(1, 2).contiguous().numpy()
    q8 = gguf.quants.quantize(down, QT.Q8_0)
    g = load_gguf(write_gpt_oss_gguf(quant, tmp_path / "mixed.gguf", replace={"blk.0.ffn_down_exps.weight": (q8, QT.Q8_0)}))
    with pytest.raises(CheckpointError, match=r"'blk\.0\.ffn_down_exps\.weight' is Q8_0 but .* is MXFP4|"
                                              r"is MXFP4 but 'blk\.0\.ffn_down_exps\.weight' is Q8_0"):
        g.quant
    dense = dict(g.weights(torch.float32))["model.layers.0.mlp.experts.down_proj.weight"]
    assert torch.equal(dense, torch.from_numpy(gguf.quants.dequantize(q8, QT.Q8_0)))


def test_missing_sliding_window_is_named(dense, tmp_path):
    with pytest.raises(CheckpointError, match="missing 'gpt-oss.attention.sliding_window'"):
        load_gguf(write_gpt_oss_gguf(dense, tmp_path / "bad.gguf", skip=("attention.sliding_window",)))


def test_sliding_window_pattern_key(dense, tmp_path):
    """A file's attention.sliding_window_pattern (one flag per layer) overrides llama.cpp's default."""
    path = write_gpt_oss_gguf(dense, tmp_path / "m.gguf", pattern=[False, True, True])
    assert load_gguf(path).config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]


def test_writer_names_are_llama_cpps(dense):
    """The writer's tensor names are the ones llama.cpp's converter gives (the gguf package's own map)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, 3)
    for name in hf_state_dict(dense):
        if ".mlp.experts." in name:
            continue
        converted = name + ".weight" if name.endswith(".sinks") else name
        assert gguf_name(name) == names.get_name(converted, try_suffixes=(".weight", ".bias")), name
    for proj, gname in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
        assert names.get_name(f"model.layers.0.mlp.experts.{proj}.weight", try_suffixes=(".weight",)) == \
            f"blk.0.{gname}.weight"
    assert gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_UP_EXP].format(bid=0) == "blk.0.ffn_gate_up_exps"
