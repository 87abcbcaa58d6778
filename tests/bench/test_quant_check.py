"""`ingot check quant`: the quantized engine's greedy tokens against the same weights dequantized."""

from __future__ import annotations

import json

import pytest
import torch

from ingot.bench.quant_check import compare
from ingot.cli import main
from tests.helpers import write_tiny_checkpoint


def test_compare_by_hand():
    prompts = [[7, 8], [9]]
    runs = [([1, 2], [-0.5, -1.0]), ([0], [-0.25])]
    lp0 = torch.full((3, 4), -5.0)
    lp0[1, 1] = -0.5  # predicts token 1: agrees, diff 0
    lp0[2, 3] = -0.1  # top-1 is 3, the engine chose 2 (logprob -5 against -1.0): disagrees, diff 4
    lp1 = torch.full((1, 4), -2.0)
    lp1[0, 0] = -0.5  # agrees, diff 0.25
    got = compare(prompts, runs, [lp0, lp1])
    assert (got.prompts, got.positions) == (2, 3)
    assert got.top1_agreement == pytest.approx(2 / 3)
    assert got.max_logprob_diff == pytest.approx(4.0) and got.mean_logprob_diff == pytest.approx((0 + 4 + 0.25) / 3)


@pytest.mark.parametrize("arch,quantization", [("llama", "int4"), ("deepseek_v3", "int8")])
def test_check_quant_end_to_end_on_cpu(tmp_path, monkeypatch, capsys, arch, quantization):
    """The engine's layers held quantized on CPU (the reference ops; ingot dequantizes at load there
    otherwise) against the dequantized model: every top-1 agrees, logprobs match to fp32 rounding
    (DeepSeek: its latent attention's cache, kv_b_proj held dense)."""
    import functools

    import ingot.engine.engine as engine_mod
    from ingot.models import loader

    monkeypatch.setattr(engine_mod, "open_model", functools.partial(loader.open_model, dequantize_on_load=False))
    path = write_tiny_checkpoint(tmp_path / arch, arch, overrides=dict(hidden_size=128, intermediate_size=256))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")
    out = tmp_path / "quant.json"
    argv = ["check", "quant", "--model", str(path), "--quantization", quantization, "--device", "cpu", "--dtype",
            "float32", "--steps", "6", "--prompts", str(prompts), "--json", str(out), "--quiet"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["positions"] == 12 and doc["top1_agreement"] == 1.0
    assert doc["max_logprob_diff"] < 1e-4 and doc["quantization"] == quantization
    assert "PASS" in capsys.readouterr().out
