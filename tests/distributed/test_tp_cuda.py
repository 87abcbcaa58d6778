"""Tensor parallelism on two GPUs (NCCL): decode graphs with the all-reduces captured in them,
compiled decode tracing the functional collectives, and a failing worker on NCCL."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.bench.drift import DecodeModes, teacher_forced
from tests.distributed.tp_helpers import alive, decode_graphs
from tests.helpers import write_tiny_checkpoint

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(50, 71)), [11, 12, 13, 14, 15]]
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=8, cudagraph_capture_sizes=(1, 2, 4, 8), show_progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tp_cuda") / "qwen2", "qwen2"))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_tp2_decode_graphs_give_tp1_greedy_tokens(tmp_path, arch):
    path = str(write_tiny_checkpoint(tmp_path / arch, arch))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for size in (1, 2):
        with LLM(path, tensor_parallel_size=size, **ENGINE) as llm:
            graphs = llm.engine.executor.run_on_ranks(decode_graphs)
            assert graphs is not None and sorted(graphs) == [1, 2, 4, 8]
            assert all(captured for captured, _ in graphs.values())  # real captures, NCCL inside
            tokens[size] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            pids = llm.engine.executor.workers.pids if size > 1 else []
    assert tokens[2] == tokens[1]
    assert pids and not any(alive(p) for p in pids)


def test_tp2_compiled_decode_matches_graph_decode(tiny):
    with LLM(tiny, tensor_parallel_size=2, **ENGINE) as llm:
        modes = DecodeModes(llm.engine, 4)
        try:
            assert modes.modes == ["eager", "graph", "compiled"]
            results = {r.mode: r for r in teacher_forced(modes, PROMPTS, 16)}
        finally:
            modes.close()
    for mode in ("eager", "compiled"):
        assert results[mode].top1_agreement == 1.0
        assert results[mode].max_rel_logit_err < 1e-4


def test_tp2_bf16_engine_serves_with_compile_on(tiny):
    """bf16 with the Triton kernels and the compiled decode captured per bucket: it runs, and
    the greedy tokens agree with graph-only decode for most of the way (no crash, no hang)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for compile_on in (False, True):
        with LLM(tiny, tensor_parallel_size=2, decode_compile=compile_on, **{**ENGINE, "dtype": "bfloat16"}) as llm:
            assert any(compiled for _, compiled in llm.engine.executor.run_on_ranks(decode_graphs).values()) == compile_on
            outs[compile_on] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    same = sum(a == b for x, y in zip(outs[False], outs[True]) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in outs[False])


def test_failing_worker_on_nccl_ends_the_step_instead_of_hanging(tiny):
    """In a child process with a deadline: a collective waiting on a dead NCCL rank must be aborted."""
    code = textwrap.dedent(f"""
        from ingot import SamplingParams
        from tests.distributed.tp_helpers import alive, fail_in_forward, tp_engine
        engine = tp_engine({tiny!r}, device="cuda", tensor_parallel_size=2, max_model_len=128, eager_mode=True)
        engine.executor.run_on_ranks(fail_in_forward, 1, 2)
        pids = engine.executor.workers.pids
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert "injected fault on rank 1 in forward" in outs[-1].error, outs[-1].error
        assert not any(alive(p) for p in pids)
        engine.close()
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]
