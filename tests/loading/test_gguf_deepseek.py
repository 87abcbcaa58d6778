"""GGUFs of DeepSeek-V2 / V3 (llama.cpp's ``deepseek2``) written from tiny HF checkpoints, against HF transformers.

The writer follows llama.cpp's converter (``DeepseekV2Model``): experts stacked per projection,
the router's correction bias as ``exp_probs_b.bias``, rope dims left in DeepSeek's pair order,
and ``kv_b_proj`` either whole (``attn_kv_b``, files of older llama.cpp, with per-head
``key_length`` / ``value_length`` and ``head_count_kv`` = heads) or split per head into
``attn_k_b`` (transposed) and ``attn_v_b`` (llama.cpp's MLA layout: ``head_count_kv`` 1,
``key_length`` the latent's, per-head sizes in ``key_length_mla`` / ``value_length_mla``). The
routing keys come from the HF config as the converter writes them; V3's ``scoring_func`` (in
every hub config, not in transformers' saved one) as ``expert_gating_func`` sigmoid. ingot's
logits and greedy tokens from the file equal transformers' on the HF checkpoint (fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import load_gguf
from tests.helpers import hf_logits, hf_model, ingot_logits, write_tiny_checkpoint
from tests.loading.gguf_fixtures import write_gguf
from tests.loading.test_gguf_moe import MOE_TO_GGUF, hf_state_dict

DS_TO_GGUF = {
    **MOE_TO_GGUF,
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "mlp.gate.e_score_correction": "exp_probs_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# V3 with mscale equal to mscale_all_dim, as in every released model (a GGUF keeps only the latter)
V3_ROPE = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
           "mscale": 0.8, "mscale_all_dim": 0.8}
CASES = {  # name: (HF architecture, config overrides, kv_b_proj split per head)
    "v3": ("deepseek_v3", dict(rope_scaling=V3_ROPE), True),
    "v2_lite": ("deepseek_v2", dict(n_group=1, topk_group=1, topk_method="greedy"), False),
    "v2_groups": ("deepseek_v2", dict(topk_group=1), True),  # experts of the best of 4 groups only
}
IDS = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()


def gguf_name(name: str) -> str:
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # the converter's rename
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{DS_TO_GGUF[rest]}.{kind}"
    return f"{DS_TO_GGUF[stem]}.{kind}"


def deepseek_tensors(sd: dict[str, torch.Tensor], cfg: dict, split_kv_b: bool) -> dict[str, np.ndarray]:
    """llama.cpp's converter: experts stacked [E, out, in] per projection; kv_b_proj per head into
    k_b [heads, kv_lora_rank, nope] (transposed) and v_b [heads, v, kv_lora_rank] with ``split_kv_b``."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name, t in sd.items():
        w = t.float().numpy()
        parts = name.split(".")
        if ".mlp.experts." in name:
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = w
            continue
        gname = gguf_name(name)
        if split_kv_b and gname.endswith("attn_kv_b.weight"):
            kv_b = w.reshape(heads, nope + v, -1)
            out[gname.replace("attn_kv_b", "attn_k_b")] = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            out[gname.replace("attn_kv_b", "attn_v_b")] = np.ascontiguousarray(kv_b[:, nope:])
            continue
        out[gname] = w
    for (layer, proj), per_expert in experts.items():
        out[f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def write_deepseek_gguf(hf_dir: Path, out: Path, split_kv_b: bool, quantize: dict[str, QT] | None = None,
                        skip: tuple[str, ...] = (), extra: dict[str, int] | None = None,
                        drop: tuple[str, ...] = ()) -> Path:
    """The GGUF of a DeepSeek checkpoint: tensors named in ``quantize`` in that type (zero blocks of
    a type gguf-py cannot quantize to), metadata keys (without the ``deepseek2.`` prefix) in
    ``skip`` left out, ``extra`` uint32 keys added, tensors in ``drop`` left out."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors: dict = deepseek_tensors(hf_state_dict(hf_dir), cfg, split_kv_b)
    for name, qtype in (quantize or {}).items():
        try:
            tensors[name] = (gguf.quants.quantize(tensors[name], qtype), qtype)
        except NotImplementedError:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tensors[name].shape
            tensors[name] = (np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8), qtype)
    for name in drop:
        del tensors[name]
    rope, heads = cfg["rope_parameters"], cfg["num_attention_heads"]
    rank, nope, rot, v = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ints = {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": 1 if split_kv_b else heads,
        "expert_count": cfg["n_routed_experts"], "expert_used_count": cfg["num_experts_per_tok"],
        "expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"],
        "leading_dense_block_count": cfg["first_k_dense_replace"], "vocab_size": cfg["vocab_size"],
        "attention.kv_lora_rank": rank, "expert_feed_forward_length": cfg["moe_intermediate_size"],
        "expert_shared_count": cfg["n_shared_experts"], "rope.dimension_count": rot,
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        **({"attention.key_length": rank + rot, "attention.value_length": rank, "attention.key_length_mla": nope + rot,
            "attention.value_length_mla": v} if split_kv_b else {"attention.key_length": nope + rot, "attention.value_length": v}),
        **({"attention.q_lora_rank": cfg["q_lora_rank"]} if cfg.get("q_lora_rank") else {}),
        **({"expert_gating_func": 2} if cfg["model_type"] == "deepseek_v3" else {}),
        **(extra or {}),
    }
    floats = {
        "rope.freq_base": rope["rope_theta"], "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        "rope.scaling.factor": rope["factor"], "rope.scaling.yarn_beta_fast": rope["beta_fast"],
        "rope.scaling.yarn_beta_slow": rope["beta_slow"], "expert_weights_scale": cfg["routed_scaling_factor"],
        "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"],
    }

    def meta(w: gguf.GGUFWriter) -> None:
        for key, value in ints.items():
            if key not in skip:
                w.add_uint32(f"deepseek2.{key}", value)
        for key, value in floats.items():
            if key not in skip:
                w.add_float32(f"deepseek2.{key}", value)
        w.add_string("deepseek2.rope.scaling.type", "yarn")
        if cfg.get("norm_topk_prob") and cfg["model_type"] == "deepseek_v3":
            w.add_bool("deepseek2.expert_weights_norm", True)

    return write_gguf(out, "deepseek2", tensors=tensors, meta=meta, hparams=False)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, overrides, split = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = write_tiny_checkpoint(root / "hf", arch, overrides=overrides)
    return request.param, hf_dir, write_deepseek_gguf(hf_dir, root / "model.gguf", split)


def test_logits_and_greedy_tokens_match_hf(case):
    name, hf_dir, path = case
    hf_config = json.loads((hf_dir / "config.json").read_text())
    cfg = load_gguf(path).config
    assert cfg["architectures"] == hf_config["architectures"]
    assert cfg["q_lora_rank"] == hf_config["q_lora_rank"] and cfg["n_group"] == hf_config["n_group"]
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    got = ingot_logits(engine, IDS, prefill_len=20, chunk=9)
    ref = hf_logits(hf_dir, IDS)
    assert (got - ref).norm() / ref.norm() < 1e-5, name
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False)
    out = llm.generate([IDS[:12]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        full = hf_model(hf_dir).generate(torch.tensor([IDS[:12]]), max_new_tokens=12, min_new_tokens=12,
                                         do_sample=False, pad_token_id=0)
    assert out[0].outputs[0].token_ids == full[0, 12:].tolist()


def test_config_fields(case):
    """The routing and attention fields, as the HF config has them."""
    name, hf_dir, path = case
    hf = json.loads((hf_dir / "config.json").read_text())
    cfg = load_gguf(path).config
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                "routed_scaling_factor", "n_group", "topk_group"):
        assert cfg[key] == hf[key], key
    if name != "v3":
        assert cfg["topk_method"] == hf["topk_method"]
    else:
        assert cfg["norm_topk_prob"] is True
    assert cfg["rope_scaling"]["mscale_all_dim"] == hf["rope_parameters"]["mscale_all_dim"]
    assert cfg["rope_scaling"]["factor"] == hf["rope_parameters"]["factor"]


def test_yarn_without_log_multiplier(tmp_path):
    """Without rope.scaling.yarn_log_multiplier llama.cpp neither scales the softmax nor the rotation:
    YaRN's attention factor 1 and no mscale_all_dim (the softmax scale 1 / sqrt(qk_head_dim))."""
    from ingot.layers.rotary import rope_frequencies, yarn_softmax_scale
    from ingot.loading.model_config import ModelConfig

    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "deepseek_v2", overrides=CASES["v2_lite"][1])
    path = write_deepseek_gguf(hf_dir, tmp_path / "m.gguf", True, skip=("rope.scaling.yarn_log_multiplier",))
    cfg = ModelConfig.from_hf(load_gguf(path).config)
    assert "mscale_all_dim" not in cfg.rope_scaling and yarn_softmax_scale(0.25, cfg.rope_scaling) == 0.25
    assert rope_frequencies(16, cfg.rope_theta, cfg.rope_scaling)[1] == 1.0


def test_split_kv_b_equals_whole(tmp_path):
    """Both kv_b_proj layouts give the checkpoint's tensor back, exactly."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "deepseek_v3", overrides=dict(rope_scaling=V3_ROPE))
    sd = hf_state_dict(hf_dir)
    for split in (False, True):
        g = load_gguf(write_deepseek_gguf(hf_dir, tmp_path / f"{split}.gguf", split))
        weights = dict(g.weights(torch.float32))
        for layer in range(3):
            name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
            assert torch.equal(weights[name], sd[name]) and g.tensor_shapes[name] == tuple(sd[name].shape)


@pytest.mark.parametrize("split_kv_b", [False, True])
def test_quantized_file_keeps_its_projections_quantized_but_kv_b(tmp_path, split_kv_b):
    """A Q8_0 file's projections come in the int form (``dequantize_on_load=False``), q with kv_a as one
    projection, but kv_b_proj: dequantized (as the dense iterator gives it) where the model holds it
    dense (``held_dense``), and wherever it is joined from attn_k_b / attn_v_b (attn_k_b's blocks run
    along what are kv_b_proj's rows)."""
    from ingot.loading.quant_scheme import IntWeights
    from ingot.models.loader import held_dense

    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "deepseek_v2", overrides={**CASES["v2_lite"][1], "qk_nope_head_dim": 32})
    kv_b = ["blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"] if split_kv_b else ["blk.0.attn_kv_b.weight"]
    names = [*(f"blk.1.ffn_{p}_exps.weight" for p in ("gate", "up", "down")), "blk.0.attn_q.weight",
             "blk.0.attn_kv_a_mqa.weight", *kv_b]
    path = str(write_deepseek_gguf(hf_dir, tmp_path / "q8.gguf", split_kv_b, quantize={n: QT.Q8_0 for n in names}))
    ckpt = open_checkpoint(path, dequantize_on_load=False, held_dense=held_dense)
    q8 = IntWeights(bits=8, group_size=32, zero_point=128)
    assert ckpt.quant.scheme_for("model.layers.0.self_attn.q_proj") == q8
    assert ckpt.quant.scheme_for("model.layers.0.self_attn.kv_a_proj_with_mqa") == q8
    assert ckpt.quant.scheme_for("model.layers.1.mlp.experts.3.down_proj") == q8
    assert ckpt.quant.scheme_for("model.layers.0.self_attn.o_proj") is None  # F32 in the file
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    got = dict(ckpt.weights(torch.float32, None))
    assert ckpt.quant.scheme_for(name.removesuffix(".weight")) is None and "model.layers.0.self_attn.kv_b_proj.qweight" not in got
    assert torch.equal(got[name], dict(open_checkpoint(path).weights(torch.float32, None))[name])
    assert "model.layers.0.self_attn.q_proj.qweight" in got and len(got) == ckpt.num_tensors
    unheld = open_checkpoint(path, dequantize_on_load=False).quant
    assert (unheld.scheme_for("model.layers.0.self_attn.kv_b_proj") is None) == split_kv_b


@pytest.mark.parametrize(("change", "match"), [
    (dict(skip=("attention.kv_lora_rank",)), "missing 'deepseek2.attention.kv_lora_rank'"),
    (dict(skip=("leading_dense_block_count",)), "missing 'deepseek2.leading_dense_block_count'"),
    (dict(extra={"leading_dense_block_count": 2}), r"leading_dense_block_count=2 but the layers with a router"),
    (dict(extra={"expert_gating_func": 3}), "expert_gating_func=3 is not supported"),
    (dict(drop=("blk.2.attn_v_b.weight",)), r"blk\.2\.attn_k_b\.weight without blk\.2\.attn_v_b\.weight"),
    (dict(drop=("blk.1.exp_probs_b.bias",)), r"blk\.1\.exp_probs_b\.bias is missing"),
    (dict(quantize={"blk.1.ffn_up_exps.weight": QT.IQ4_NL}), "quantized as IQ4_NL, which ingot cannot dequantize"),
])
def test_bad_files_are_named(tmp_path, change, match):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "deepseek_v3", overrides=dict(rope_scaling=V3_ROPE))
    with pytest.raises(CheckpointError, match=match):
        load_gguf(write_deepseek_gguf(hf_dir, tmp_path / "bad.gguf", True, **change))


def test_writer_names_are_llama_cpps(tmp_path):
    """The writer's tensor names are the ones llama.cpp's converter gives (the gguf package's own map)."""
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "deepseek_v3", overrides=dict(rope_scaling=V3_ROPE))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, 3)
    for name in hf_state_dict(hf_dir):
        if ".mlp.experts." in name:
            continue
        converted = name.replace("e_score_correction_bias", "e_score_correction.bias")
        assert gguf_name(name) == names.get_name(converted, try_suffixes=(".weight", ".bias")), name
    for split in ("k_b_proj", "v_b_proj"):
        assert names.get_name(f"model.layers.0.self_attn.{split}.weight", try_suffixes=(".weight",)) == \
            f"blk.0.attn_{split[0]}_b.weight"
