"""Tiny MoE models on the GPU with the Triton kernels (marked cuda; run on the H200).

fp32 engines against HF transformers (fp32, CPU): the kernels (fused_moe's per-pair and
grouped paths, IEEE fp32 products) keep the logits within accumulation-order noise and the
greedy tokens of the whole engine (captured decode graphs, the sampler) equal HF's; then
captured and compiled decode against eager on one bf16 engine.
"""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from tests.helpers import OpNames, hf_logits, hf_model, ingot_logits, write_tiny_checkpoint

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_logits_on_cuda_match_hf(tmp_path, arch):
    path = write_tiny_checkpoint(tmp_path / arch, arch)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cuda", eager_mode=True,
                                             show_progress=False, gpu_memory_utilization=0.2))
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with OpNames() as ran:
        got = ingot_logits(engine, ids, prefill_len=30, chunk=7)  # prefill: grouped path; decode: per pair
    ref = hf_logits(path, ids)
    assert "ingot.fused_moe" in ran.names
    # fp32 on CUDA: the attention kernels multiply fp32 Q and K in TF32 (Triton's default for
    # fp32 tl.dot), so logits sit about 5e-4 from HF's fp32 CPU reference (measured on the H200
    # for qwen3_moe); the fused-MoE kernel itself computes fp32 products in full fp32
    assert (got - ref).norm() / ref.norm() < 2e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_generate_with_graphs_matches_hf(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "q3", "qwen3_moe", seed=3)
    llm = LLM(str(path), dtype="float32", device="cuda", show_progress=False, gpu_memory_utilization=0.2,
              cudagraph_capture_sizes=(1, 2, 4))
    assert llm.engine.executor.graphs is not None
    prompts = [[5, 17, 80, 33, 120, 7], [44, 9, 250, 61], [3, 3, 90]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    reference = hf_model(path)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            full = reference.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      pad_token_id=0)
        assert out.outputs[0].token_ids == full[0, len(prompt):].tolist()


def test_graph_and_compiled_decode_match_eager_bf16(tmp_path):
    """One bf16 engine, every decode mode on the same KV cache (the drift check's machinery)."""
    from ingot.bench.drift import DecodeModes, free_running, teacher_forced

    path = write_tiny_checkpoint(tmp_path / "q2", "qwen2_moe", seed=4)
    llm = LLM(str(path), dtype="bfloat16", device="cuda", show_progress=False, gpu_memory_utilization=0.2,
              max_num_seqs=4, cudagraph_capture_sizes=(1, 4), max_model_len=256)
    prompts = [[5, 17, 80, 33, 120, 7], [44, 9, 250, 61], [3, 3, 90], [200, 100, 50, 25, 12]]
    for bucket in (1, 4):
        modes = DecodeModes(llm.engine, bucket)
        assert "compiled" in modes.modes
        tf = {r.mode: r for r in teacher_forced(modes, prompts, 16)}
        for mode in ("eager", "compiled"):  # against graph decode, teacher-forced
            assert tf[mode].top1_agreement >= 0.98 and tf[mode].max_rel_logit_err < 2e-2, tf[mode]
        fr = {r.mode: r for r in free_running(modes, prompts, 16)}
        assert fr["compiled"].token_agreement >= 0.9, fr["compiled"]
