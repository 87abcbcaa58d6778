"""Speculative decoding's verify graphs on a real GPU (marked cuda; run on the H200).

The Triton kernels store every verify row's K/V before any row attends (the fused decode op
would let a row read a slot another program of the same launch has not written yet): each
row's logits equal a full prefill's, through captured graphs; greedy decoding with
speculation emits plain greedy decoding's tokens with every verify step replayed from a
graph, raw or compiled."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.runner.graph_runner import DecodeGraphRunner
from tests.helpers import write_tiny_checkpoint
from tests.models.gpt_oss_cases import write_gpt_oss
from tests.runner.test_verify_rows import FAMILIES, SPEC, poison_rows, verify_rows_case

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "model"
    if request.param == "gpt_oss":
        return write_gpt_oss(path, seed=1)
    return write_tiny_checkpoint(path, request.param)


def close_to(logits: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 on CUDA: the attention kernels multiply fp32 Q and K in TF32 (Triton's default), so
    rows and prefill each sit about 5e-4 from exact fp32 (tests/models/test_moe_cuda.py)."""
    got = logits.float().cpu()
    assert not torch.isnan(got).any(), "a row read K/V before the step wrote it"
    assert (got - expected).norm() / expected.norm() < 2e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_verify_graph_rows_equal_the_prefill_of_the_drafts(checkpoint):
    """fp32: 9 verify rows, their cache slots NaN before each forward, through the raw forward
    and a captured graph of 12 rows equal the full prefill's logits."""
    engine, inputs, expected = verify_rows_case(checkpoint, "cuda", eager_mode=True)
    runner = engine.executor
    poison_rows(runner, inputs)
    close_to(runner.raw_logits(inputs), expected)
    graphs = DecodeGraphRunner(runner.model, runner.config, runner.device, 8, runner.policy, store_first=True,
                               buckets=[12])
    graphs.capture_all()
    assert graphs.entries[12].graph is not None
    for _ in range(2):
        poison_rows(runner, inputs)
        close_to(graphs.run(inputs), expected)


@pytest.mark.parametrize("arch,decode_compile", [("qwen3", False), ("qwen3", True), ("gemma2", False),
                                                 ("deepseek_v2", False)])
def test_greedy_through_verify_graphs_equals_plain_greedy(tmp_path, arch, decode_compile):
    """fp32 engines on CUDA with graphs: greedy speculation's tokens are plain greedy decoding's,
    every verify step a replay of a captured verify graph (compiled with decode_compile on)."""
    path = str(write_tiny_checkpoint(tmp_path / arch, arch))
    prompts = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "hello world hello world hello",
               "def f(x): return x", "Hello tokens Hello tokens Hello"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    common = dict(dtype="float32", device="cuda", show_progress=False, max_num_seqs=8, max_model_len=256,
                  num_kv_blocks=256, decode_compile=decode_compile)
    with LLM(path, **common) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, speculative_config=SPEC, **common) as llm:
        graphs = llm.engine.executor.verify_graphs
        assert graphs is not None and all(e.graph is not None for e in graphs.entries.values())
        assert graphs.compiled == decode_compile
        rows: list[int] = []
        run = graphs.run
        graphs.run = lambda inputs: rows.append(inputs.num_seqs) or run(inputs)
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats()
    assert spec == plain
    assert rows and stats.spec_decode_num_accepted_tokens > 0
