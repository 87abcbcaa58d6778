"""ingot vs HF transformers on small random Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 checkpoints."""

from __future__ import annotations

import pytest
import torch

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from tests.helpers import hf_logits, ingot_logits, write_tiny_checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_logits_match_hf(tmp_path, arch):
    path = write_tiny_checkpoint(tmp_path / arch, arch)
    assert (path / "model.safetensors.index.json").exists(), "checkpoint should be sharded"
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (40,), generator=gen).tolist()
    ref = hf_logits(path, ids)
    # prefill in chunks of 7 (crossing 16-token blocks), then decode the rest token by token
    got = ingot_logits(engine, ids, prefill_len=30, chunk=7)
    err = (got - ref).norm() / ref.norm()
    assert err < 1e-5, f"{arch}: relative logit error {err:.2e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch,max_n,fused_norms_per_layer", [
    ("qwen2", 8192, 2), ("qwen3", 8192, 2),
    ("qwen2", 200, 1),  # qkv (128 outputs) takes the norm, gate/up (256) gets its own
])
def test_fused_prologue_path_matches_hf(tmp_path, monkeypatch, arch, max_n, fused_norms_per_layer):
    """Decode rows on the skinny path take the norm and SiLU fused into their GEMMs
    (ingot.rms_norm_linear, ingot.silu_mul_linear), the norm only into projections of at
    most NORM_PROLOGUE_MAX_N outputs; the logits still match HF."""
    import ingot.layers.linear as linear
    import ingot.ops.reference as reference
    from ingot.layers.policy import OpPolicy

    monkeypatch.setattr(linear, "NORM_PROLOGUE_MAX_N", max_n)

    calls = {"rms_norm_linear": 0, "silu_mul_linear": 0}
    for name in calls:
        original = getattr(reference, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(reference, name, counted)
    path = write_tiny_checkpoint(tmp_path / arch, arch)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.executor.policy = OpPolicy(skinny_rows=1)  # the runner turns it off without CUDA kernels
    got = ingot_logits(engine, ids, prefill_len=16)
    layers = engine.executor.model.config.num_layers
    decode_steps = len(ids) - 16
    # per layer: the post-attention norm (if fused), the next layer's input norm (not the first
    # layer's), the MLP
    fused_norms = (layers - 1) + (layers if fused_norms_per_layer == 2 else 0)
    assert calls == {"rms_norm_linear": decode_steps * fused_norms, "silu_mul_linear": decode_steps * layers}
    ref = hf_logits(path, ids)
    assert (got - ref).norm() / ref.norm() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
