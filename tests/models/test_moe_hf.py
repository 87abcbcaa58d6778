"""ingot vs HF transformers (fp32) on tiny random Qwen3-MoE / Qwen2-MoE / Mixtral / OLMoE checkpoints."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.models.moe import MoEBlock
from tests.helpers import MOE_ARCHS, hf_logits, hf_model, ingot_logits, write_tiny_checkpoint


def _engine(path) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))


def _check_logits(path, seed: int = 1) -> None:
    engine = _engine(path)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref = hf_logits(path, ids)
    # prefill in chunks of 7 (crossing 16-token blocks), then decode the rest token by token
    got = ingot_logits(engine, ids, prefill_len=30, chunk=7)
    err = (got - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative logit error {err:.2e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_hf(tmp_path, arch):
    """Per-expert checkpoint tensors (what save_pretrained writes), stacked at load."""
    path = write_tiny_checkpoint(tmp_path / arch, arch)
    assert (path / "model.safetensors.index.json").exists(), "checkpoint should be sharded"
    _check_logits(path)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_fused_expert_layout_matches_hf(tmp_path, arch):
    """transformers' own stacked layout (save_original_format=False): experts.gate_up_proj [E, 2I, H]."""
    path = write_tiny_checkpoint(tmp_path / arch, arch, fused_experts=True)
    index = (path / "model.safetensors.index.json").read_text()
    assert "experts.gate_up_proj" in index and "experts.0." not in index
    _check_logits(path, seed=2)


def test_layer_kinds_follow_the_config(tmp_path):
    """mlp_only_layers and decoder_sparse_step pick the dense layers as HF does."""
    for arch, sparse in (("qwen3_moe", [True, False, True]), ("qwen2_moe", [False, True, False])):
        model = _engine(write_tiny_checkpoint(tmp_path / arch, arch)).executor.model
        assert [isinstance(layer.mlp, MoEBlock) for layer in model.layers] == sparse, arch
        reference = hf_model(tmp_path / arch)
        hf_sparse = [hasattr(layer.mlp, "experts") for layer in reference.model.layers]
        assert hf_sparse == sparse, arch


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_generate_matches_hf_generate(tmp_path, arch):
    """The whole engine (continuous batching, prefill + decode, sampler): greedy tokens equal HF's."""
    path = write_tiny_checkpoint(tmp_path / arch, arch, seed=3)
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False)
    prompts = [[5, 17, 80, 33, 120, 7], [44, 9, 250, 61]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    reference = hf_model(path)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            full = reference.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      pad_token_id=0)
        assert out.outputs[0].token_ids == full[0, len(prompt):].tolist()


def test_missing_and_foreign_expert_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from ingot.loading.errors import CheckpointError

    path = write_tiny_checkpoint(tmp_path / "m", "mixtral")
    shard = sorted(path.glob("model-*.safetensors"))
    drop = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    for file in shard:
        tensors = load_file(file)
        if drop in tensors:
            del tensors[drop]
            save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing weights: layers\.1\.mlp\.experts\.w_down#3#0"):
        _engine(path)


def test_expert_tensors_stream_into_the_stacked_parameters(tmp_path):
    """Each per-expert tensor is copied into its slice of [E, ...] and dropped: the loader holds
    at most the tensor it is copying, never a host-side stack of the experts."""
    import weakref

    from ingot.loading.checkpoint import open_checkpoint
    from ingot.models.loader import build_model

    path = write_tiny_checkpoint(tmp_path / "m", "mixtral")
    ckpt = open_checkpoint(str(path))
    model = build_model(ckpt.config, torch.float32, torch.device("cpu"), 64)
    seen: list[weakref.ref] = []
    copies: dict[str, torch.Tensor] = {}

    def stream():
        for name, tensor in ckpt.weights(torch.float32):
            # the loader's loop variable still holds the previous tensor; none before it may live
            assert all(r() is None for r in seen[:-1]), "the loader kept an earlier tensor"
            seen.append(weakref.ref(tensor))
            if name == "model.layers.1.block_sparse_moe.experts.2.w3.weight":
                copies["up"] = tensor.clone()
            yield name, tensor

    model.load_weights(stream())
    assert len(seen) == ckpt.num_tensors
    experts = model.layers[1].mlp.experts
    inter = experts.intermediate_size
    assert torch.equal(experts.w_gate_up[2, inter:], copies["up"])  # up rows follow the gate rows


@pytest.mark.parametrize("policy", ["skinny", "native"])
def test_op_policy_reaches_the_moe_block(tmp_path, monkeypatch, policy):
    """The runner's OpPolicy is threaded into the MoE block like the dense MLP gets it: decode rows on
    the skinny path send the router and the shared expert through skinny_linear / silu_mul_linear;
    a compile policy with native ops runs their PyTorch forms. Logits still equal HF's."""
    import ingot.ops.reference as reference
    from ingot.layers.policy import OpPolicy
    from tests.helpers import OpNames

    calls = {"skinny_linear": 0, "silu_mul_linear": 0}
    for name in calls:
        original = getattr(reference, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(reference, name, counted)
    path = write_tiny_checkpoint(tmp_path / "q2", "qwen2_moe")
    engine = _engine(path)
    engine.executor.policy = OpPolicy(skinny_rows=1) if policy == "skinny" else OpPolicy().with_native(["silu_and_mul"])
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    with OpNames() as ran:
        got = ingot_logits(engine, ids, prefill_len=16)
    ref = hf_logits(path, ids)
    assert (got - ref).norm() / ref.norm() < 1e-5 and torch.equal(got.argmax(-1), ref.argmax(-1))
    assert "ingot.fused_moe" in ran.names
    sparse = sum(isinstance(layer.mlp, MoEBlock) for layer in engine.executor.model.layers)
    decode_steps = len(ids) - 16
    if policy == "skinny":  # per decode step and sparse layer: the router GEMV, the shared gate_up GEMV + fused down
        assert calls["silu_mul_linear"] >= decode_steps * sparse
        assert calls["skinny_linear"] >= decode_steps * 2 * sparse
        assert "ingot.linear_norm_linear_scaled" not in ran.names  # the shared expert needs the normed rows themselves
    else:  # no SiLU-and-mul op anywhere (dense MLP or shared expert): its PyTorch form ran instead
        assert calls == {"skinny_linear": 0, "silu_mul_linear": 0} and "ingot.silu_and_mul" not in ran.names


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_norm_and_router_ride_in_o_proj(tmp_path, monkeypatch, arch):
    """Without a shared expert, decode rows on the skinny path run o_proj, the MoE block's norm
    and its router as one op (ingot.linear_norm_linear_scaled, once per sparse layer and step),
    and the experts scale their sums by the rstd it hands on: the logits still equal HF's."""
    import ingot.ops.reference as reference
    from ingot.layers.policy import OpPolicy

    calls = {"linear_norm_linear_scaled": 0, "fused_moe_scaled": 0}
    original_op, original_moe = reference.linear_norm_linear_scaled, reference.fused_moe

    def fused(*args):
        calls["linear_norm_linear_scaled"] += 1
        return original_op(*args)

    def moe(*args):
        calls["fused_moe_scaled"] += len(args) > 5 and args[5] is not None
        return original_moe(*args)

    monkeypatch.setattr(reference, "linear_norm_linear_scaled", fused)
    monkeypatch.setattr(reference, "fused_moe", moe)
    path = write_tiny_checkpoint(tmp_path / arch, arch)
    engine = _engine(path)
    engine.executor.policy = OpPolicy(skinny_rows=1)
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    got = ingot_logits(engine, ids, prefill_len=16)
    ref = hf_logits(path, ids)
    assert (got - ref).norm() / ref.norm() < 1e-5 and torch.equal(got.argmax(-1), ref.argmax(-1))
    sparse = sum(isinstance(layer.mlp, MoEBlock) for layer in engine.executor.model.layers)
    decode_steps = len(ids) - 16
    assert sparse > 0 and calls == {"linear_norm_linear_scaled": decode_steps * sparse,
                                    "fused_moe_scaled": decode_steps * sparse}
