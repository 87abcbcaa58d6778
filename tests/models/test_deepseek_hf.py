"""ingot vs HF transformers (fp32) on tiny random DeepSeek-V2 / V3 checkpoints: latent attention over
the compressed cache, YaRN, interleaved rope, grouped routing, shared experts, dense first layer."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import ConfigError, EngineConfig
from ingot.engine.engine import Engine
from ingot.loading.dummy import SHAPES
from ingot.loading.errors import CheckpointError
from ingot.loading.model_config import ModelConfig
from ingot.models.deepseek_moe import DeepseekMoE
from ingot.models.registry import check_tensor_parallel
from ingot.runner.kv_pool import KVCachePool
from tests.helpers import ARCHS, hf_logits, hf_model, ingot_logits, write_tiny_checkpoint

DEEPSEEK = ("deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module", params=DEEPSEEK)
def checkpoint(request, tmp_path_factory):
    return request.param, write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_logits_match_hf(checkpoint):
    """Prefill in chunks of 7 (crossing 16-token blocks), then decode token by token."""
    _, path = checkpoint
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(path, ids)
    got = ingot_logits(engine, ids, prefill_len=30, chunk=7)
    assert (got - ref).norm() / ref.norm() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    model = engine.executor.model
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in model.layers] == [False, True, True]  # first_k_dense_replace


def test_generate_matches_hf_generate(checkpoint):
    """The whole engine with chunked prefill (8-token steps) and then a prefix-cache hit: greedy
    tokens equal HF's for two prompts of different lengths."""
    _, path = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 300, (16,), generator=gen).tolist()  # one whole block
    prompts = [shared + torch.randint(3, 300, (n,), generator=gen).tolist() for n in (6, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = hf_model(path)
    for round_ in range(2):  # the second round finds the shared block cached
        hits = llm.engine.stats().prefix_cache_hits
        outs = llm.generate(prompts, params, use_tqdm=False)
        if round_:
            assert llm.engine.stats().prefix_cache_hits - hits >= 2 * 16
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                full = reference.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                          pad_token_id=0)
            assert out.outputs[0].token_ids == full[0, len(prompt):].tolist()


def test_cache_holds_the_latent_and_rope_key(checkpoint):
    """One tensor per layer of kv_lora_rank + rope dims per token, no V tensors; the pool's size
    per block counts just that."""
    _, path = checkpoint
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False, num_kv_blocks=5))
    kv = engine.executor.kv
    assert kv.v == [] and len(kv.k) == 3 and tuple(kv.k[0].shape) == (5, 16, 1, 32 + 16)
    assert engine.executor._bytes_per_block() == 3 * 16 * (32 + 16) * 4


def test_kv_bytes_per_token_of_v2_lite():
    """(kv_lora_rank + rope dims) x layers x 2 bytes in bf16: 31104 bytes per token for V2-Lite."""
    cfg = ModelConfig.from_hf(SHAPES["deepseek-v2-lite"])
    entry = cfg.kv_cache_entry
    assert (entry.heads, entry.head_dim, entry.separate_values) == (1, 576, False)
    per_block = KVCachePool.bytes_per_block(cfg.num_layers, 16, entry.heads, entry.head_dim, torch.bfloat16,
                                            entry.separate_values)
    assert per_block // 16 == (512 + 64) * 27 * 2 == 31104


def _config(arch: str, **overrides) -> ModelConfig:
    fields = {k: v for k, v in ARCHS[arch].items() if k != "model_type"}
    fields.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=384, **overrides)
    return ModelConfig.from_hf({"num_hidden_layers": 3, **fields})


def test_unsupported_settings_are_named():
    with pytest.raises(CheckpointError, match="topk_method='noaux_tc'"):
        _config("deepseek_v2", topk_method="noaux_tc")
    with pytest.raises(CheckpointError, match="topk_group=3"):
        _config("deepseek_v3", topk_group=3)
    with pytest.raises(CheckpointError, match="kv_lora_rank"):
        _config("deepseek_v2", kv_lora_rank=None)
    with pytest.raises(ConfigError, match="latent attention is not split"):
        check_tensor_parallel(_config("deepseek_v3"), 2)
    assert _config("deepseek_v3").mla.q_lora_rank == 24 and _config("deepseek_v2").mla.q_lora_rank is None


def test_moe_layer_freq_and_dense_layers():
    cfg = _config("deepseek_v2", num_hidden_layers=6, first_k_dense_replace=2, moe_layer_freq=2)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]


def test_padded_decode_graph_path_matches_eager(checkpoint, monkeypatch):
    """Decode through the graph runner's padded buckets (CPU fake capture): 3 sequences in
    bucket 4, the padding row writing and reading only the dummy block; tokens equal eager's."""
    from ingot.runner import graph_runner

    _, path = checkpoint
    prompts = [[5, 17, 80, 33, 120, 7], [44, 9, 250, 61], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_seqs=4, **kw)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    _, eager = run(eager_mode=True)
    monkeypatch.setattr(graph_runner, "CPU_BUCKETS", True)
    llm, padded = run()
    assert llm.engine.executor.graphs is not None and padded == eager


def test_yarn_table_and_scale_of_v2_lite_match_transformers():
    """V2-Lite's YaRN (factor 40 over 4096, mscale 0.707 both): inverse frequencies and attention
    factor as transformers' rope init computes them, and the softmax scale its attention uses."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

    from ingot.layers.rotary import rope_frequencies, yarn_softmax_scale

    fields = {k: v for k, v in SHAPES["deepseek-v2-lite"].items() if k != "architectures"}
    hf_cfg = transformers.DeepseekV2Config(**fields)
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = ModelConfig.from_hf(SHAPES["deepseek-v2-lite"])
    got, got_attention = rope_frequencies(cfg.mla.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(got, inv_freq) and got_attention == attention
    assert yarn_softmax_scale(192**-0.5, cfg.rope_scaling) == hf.yarn_apply_mscale(hf_cfg.rope_parameters, 192**-0.5)


@pytest.mark.parametrize("arch", DEEPSEEK)
def test_loads_on_a_device_other_than_the_cpu(tmp_path, arch):
    """The loader's tensors meet the model's own (the rope row order) on the model's device:
    'meta' stands for the GPU, where the model is built."""
    from ingot.loading.checkpoint import open_checkpoint
    from ingot.models.loader import load_checkpoint

    path = write_tiny_checkpoint(tmp_path / arch, arch)
    model = load_checkpoint(open_checkpoint(str(path)), torch.float32, torch.device("meta"), 64, progress=False)
    assert all(p.device.type == "meta" for p in model.parameters())
