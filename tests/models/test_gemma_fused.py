"""Gemma 2 / 3 on the fused ops: its ``(1 + w)`` norms folded into Llama's RMSNorm at load, the
norms before its qkv and gate/up GEMVs fused into them (add + norm + GEMV), GeGLU fused into
the down projection's GEMV, and the padded decode-graph path; against HF in fp32 (CPU)."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from tests.helpers import hf_logits, ingot_logits, write_tiny_checkpoint

ARCHS = ["gemma2", "gemma3"]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def test_fused_path_matches_hf(checkpoint, monkeypatch):
    """Decode rows on the skinny path: every layer's pre-feedforward norm and every layer's input
    norm but the first's ride in their GEMVs (ingot.rms_norm_linear), GeGLU in the down
    projection's (ingot.gelu_tanh_mul_linear); logits still HF's."""
    import ingot.ops.reference as reference
    import ingot.ops.reference_geglu as reference_geglu
    from ingot.layers.policy import OpPolicy

    calls = {"rms_norm_linear": 0, "gelu_tanh_mul_linear": 0, "silu_mul_linear": 0}
    for name in calls:
        module = reference_geglu if name.startswith("gelu") else reference
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(module, name, counted)
    engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", show_progress=False))
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.executor.policy = OpPolicy(skinny_rows=1)  # the runner turns it off without CUDA kernels
    got = ingot_logits(engine, ids, prefill_len=16)
    layers, steps = engine.executor.model.config.num_layers, len(ids) - 16
    assert calls == {"rms_norm_linear": steps * (2 * layers - 1), "gelu_tanh_mul_linear": steps * layers,
                     "silu_mul_linear": 0}
    ref = hf_logits(checkpoint, ids)
    assert (got - ref).norm() / ref.norm() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_padded_decode_graph_path_matches_eager(checkpoint, monkeypatch):
    """Decode through the graph runner's padded buckets (CPU fake capture): 3 sequences in
    bucket 4, the padding row writing and reading only the dummy block; tokens equal eager's."""
    from ingot.runner import graph_runner

    prompts = [[5, 17, 80, 33, 120, 7], [44, 9, 250, 61], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(checkpoint), dtype="float32", device="cpu", show_progress=False, max_num_seqs=4, **kw)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    _, eager = run(eager_mode=True)
    monkeypatch.setattr(graph_runner, "CPU_BUCKETS", True)
    llm, padded = run()
    assert llm.engine.executor.graphs is not None and padded == eager


def test_norm_weights_fold_one_plus_w_rounded_once(checkpoint):
    """In bf16 each norm holds ``1 + w``, w as HF holds it (the fp32 checkpoint's cast to bf16),
    summed in fp32 and rounded to bf16 once (q/k norms too)."""
    from safetensors.torch import load_file

    engine = Engine(EngineConfig(model=str(checkpoint), dtype="bfloat16", device="cpu", show_progress=False))
    model = engine.executor.model
    stored = {}
    for shard in checkpoint.glob("*.safetensors"):
        stored.update(load_file(shard))
    names = [n for n in stored if n.endswith("norm.weight")]
    assert any("q_norm" in n for n in names) == (model.config.architecture == "Gemma3ForCausalLM")
    for name in names:
        param = model.get_parameter(name.removeprefix("model."))
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, (1.0 + stored[name].to(torch.bfloat16).float()).to(torch.bfloat16)), name
