"""deepseek2 and gpt-oss GGUFs on the GPU (marked cuda; run on the H200).

Where ingot keeps weights quantized (CUDA): a gpt-oss GGUF's MXFP4 experts are held in the fp8
1x32 form and multiplied by ``fused_moe_fp8``, as an HF MXFP4 checkpoint's; a DeepSeek GGUF with
Q8_0 projections is served dense (its models hold no quantized layers). fp32 engines against HF
transformers (fp32, CPU) on the same weights, within the TF32 attention noise of
test_moe_cuda.py; greedy tokens through captured decode graphs equal HF's.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from tests.helpers import OpNames, hf_logits, hf_model, ingot_logits, write_tiny_checkpoint
from tests.loading.test_gguf_deepseek import V3_ROPE, write_deepseek_gguf
from tests.loading.test_gguf_gpt_oss import IDS, mxfp4_twins, write_gpt_oss_gguf  # noqa: F401 (fixture)

pytestmark = pytest.mark.cuda


def cuda_engine(path) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", device="cuda", eager_mode=True, show_progress=False,
                               gpu_memory_utilization=0.2))


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert (got - ref).norm() / ref.norm() < 2e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def greedy_matches_hf(path, hf_dir, prompt: list[int]) -> None:
    llm = LLM(str(path), dtype="float32", device="cuda", show_progress=False, gpu_memory_utilization=0.2,
              cudagraph_capture_sizes=(1, 2))
    assert llm.engine.executor.graphs is not None
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        full = hf_model(hf_dir).generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                         do_sample=False, pad_token_id=0)
    assert out[0].outputs[0].token_ids == full[0, len(prompt):].tolist()


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_gpt_oss_mxfp4_experts_held_as_fp8(mxfp4_twins, tmp_path, fuse_gate_up):  # noqa: F811
    quant, dense_dir = mxfp4_twins
    path = write_gpt_oss_gguf(quant, tmp_path / "mxfp4.gguf", fuse_gate_up)
    engine = cuda_engine(path)
    experts = engine.executor.model.layers[0].mlp.experts
    assert experts.w_gate_up.dtype == torch.float8_e4m3fn and experts.w_down.dtype == torch.float8_e4m3fn
    with OpNames() as ran:
        got = ingot_logits(engine, IDS, prefill_len=22, chunk=7)
    assert "ingot.fused_moe_fp8" in ran.names
    assert_close(got, hf_logits(dense_dir, IDS))
    if not fuse_gate_up:
        greedy_matches_hf(path, dense_dir, IDS[:21])


def test_deepseek_quantized_gguf_served_dense(tmp_path):
    # q_lora_rank 32: attn_q_b's rows in whole Q8_0 blocks of 32
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "deepseek_v3", overrides=dict(rope_scaling=V3_ROPE, q_lora_rank=32))
    path = write_deepseek_gguf(hf_dir, tmp_path / "f32.gguf", True)
    assert_close(ingot_logits(cuda_engine(path), IDS, prefill_len=20, chunk=9), hf_logits(hf_dir, IDS))
    greedy_matches_hf(path, hf_dir, IDS[:12])
    q8 = write_deepseek_gguf(hf_dir, tmp_path / "q8.gguf", True, quantize={
        "blk.1.ffn_up_exps.weight": QT.Q8_0, "blk.0.attn_q_b.weight": QT.Q8_0})
    experts = cuda_engine(q8).executor.model.layers[1].mlp.experts
    assert experts.w_gate_up.dtype == torch.float32 and experts.scheme is None
