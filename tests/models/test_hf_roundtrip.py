"""ingot vs HF transformers on small random Llama / Qwen2 / Qwen3 / Mistral checkpoints."""

from __future__ import annotations

import pytest
import torch

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from tests.helpers import hf_logits, ingot_logits, write_tiny_checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_match_hf(tmp_path, arch):
    path = write_tiny_checkpoint(tmp_path / arch, arch)
    assert (path / "model.safetensors.index.json").exists(), "checkpoint should be sharded"
    engine = Engine.from_config(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (40,), generator=gen).tolist()
    ref = hf_logits(path, ids)
    # prefill in chunks of 7 (crossing 16-token blocks), then decode the rest token by token
    got = ingot_logits(engine, ids, prefill_len=30, chunk=7)
    err = (got - ref).norm() / ref.norm()
    assert err < 1e-5, f"{arch}: relative logit error {err:.2e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
