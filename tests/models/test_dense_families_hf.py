"""ingot vs HF transformers (fp32, CPU) on tiny random Phi-3 (fused projections, partial rotary,
LongRoPE), OLMo 2 (norms after the sublayers) and SmolLM3 (a layer without rotary) checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.loading.errors import CheckpointError
from tests.helpers import ARCHS, DENSE_FAMILIES, hf_model, ingot_logits, write_tiny_checkpoint

ORIGINAL = ARCHS["phi3"]["original_max_position_embeddings"]  # Phi-3's LongRoPE switch length
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    return {arch: write_tiny_checkpoint(root / arch, arch, seed=7) for arch in DENSE_FAMILIES}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path, **kwargs) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False, **kwargs))


@pytest.mark.parametrize("arch,length,max_model_len", [
    ("phi3", ORIGINAL, ORIGINAL),  # short LongRoPE factors: the context fits the original one
    ("phi3", ORIGINAL + 24, None),  # long factors: the sequence exceeds it, as HF's does
    ("olmo2", 40, None),
    ("smollm3", 40, None),
])
def test_logits_match_hf(checkpoints, arch, length, max_model_len):
    """Prefill in chunks of 7 (crossing 16-token blocks), then decode token by token."""
    path = checkpoints[arch]
    engine = _engine(path, max_model_len=max_model_len)
    ids = _ids(length, seed=length)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    got = ingot_logits(engine, ids, prefill_len=length - 10, chunk=7)
    err = (got - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative logit error {err:.2e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch,lengths,max_model_len", [
    ("phi3", (20, 37), ORIGINAL),  # prompt + generation under original_max_position_embeddings
    ("phi3", (ORIGINAL + 3, ORIGINAL + 21), None),  # beyond it
    ("olmo2", (23, 41), None),
    ("smollm3", (23, 41), None),
])
def test_generate_matches_hf_generate(checkpoints, arch, lengths, max_model_len):
    """The whole engine (continuous batching of prompts of different lengths, sampler): greedy
    tokens equal HF's."""
    path = checkpoints[arch]
    prompts = [_ids(n, seed=100 + n) for n in lengths]
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_model_len=max_model_len)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    llm.shutdown()
    reference = hf_model(path)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            full = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == full[0, len(prompt):].tolist()


def test_family_features_are_read_from_the_config(checkpoints):
    phi3 = _engine(checkpoints["phi3"]).executor.model
    assert phi3.config.rotary_dim == 8 < phi3.config.head_dim == 16 and phi3.head_order is not None
    smol = _engine(checkpoints["smollm3"]).executor.model
    assert smol.config.nope_layers == (1,)
    assert smol.layers[1].self_attn.rotary is not smol.layers[0].self_attn.rotary is smol.layers[2].self_attn.rotary
    olmo = _engine(checkpoints["olmo2"]).executor.model
    assert olmo.config.qk_norm_full_width and not hasattr(olmo.layers[0], "input_layernorm")


def _with_config(src, dst, **changes):
    """A copy of checkpoint ``src`` whose config.json has ``changes`` (None deletes a key)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("arch,changes,message", [
    ("phi3", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     r"rope_scaling\.rope_type 'dynamic'"),
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 4,
                                   "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
     r"rope_scaling\.short_factor must list 4 numbers"),
    ("phi3", dict(original_max_position_embeddings=None,
                  rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}),
     "original_max_position_embeddings"),
    ("phi3", dict(partial_rotary_factor=0.3125, rope_parameters=None), "partial_rotary_factor"),
    ("smollm3", dict(no_rope_layers=[1, 0]), "no_rope_layers has 2 entries"),
])
def test_bad_configs_name_the_field(checkpoints, tmp_path, arch, changes, message):
    path = _with_config(checkpoints[arch], tmp_path / arch, **changes)
    with pytest.raises(CheckpointError, match=message):
        _engine(path, max_model_len=ORIGINAL)
