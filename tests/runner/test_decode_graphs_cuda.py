"""Decode CUDA graphs and compiled decode on a real GPU (marked cuda; run on the H200).

Reports (printed, and written as JSON when INGOT_REPORT_DIR is set) the drift
numbers the docs quote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.bench.drift import DecodeModes, as_dicts, free_running, teacher_forced

pytestmark = pytest.mark.cuda

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain recursion."}],
]
PLAIN = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import torch\nimport numpy as np\n\n",
]


def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode_chat(c) for c in CHATS] + [tok.encode(p) for p in PLAIN]


def report(name: str, data) -> None:
    print(f"\n{name}: {json.dumps(data, indent=1)}")
    out = os.environ.get("INGOT_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=1))


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(str(smollm2_gguf), dtype="bfloat16", device="cuda", max_num_seqs=8,
               cudagraph_capture_sizes=(1, 8), show_progress=False, max_model_len=1024, gpu_memory_utilization=0.3)


def test_graph_replay_bitwise_equals_raw_forward(llm, monkeypatch):
    """Compile off: at every step, replay == the raw forward on the same padded buffers."""
    graphs = llm.engine.executor.graphs
    assert graphs is not None and not graphs.compiled
    mismatches = []
    steps = []

    def checked_run(inputs):
        bucket = graphs.bucket_for(inputs.num_seqs)
        graphs.buffers.fill(inputs, bucket)
        with torch.inference_mode():
            raw = graphs.raw_forward(*graphs.buffers.view(bucket)).clone()
        entry = graphs.entries[bucket]
        entry.graph.replay()
        out = entry.output
        steps.append(bucket)
        if not torch.equal(out, raw):
            mismatches.append((len(steps), float((out.float() - raw.float()).abs().max())))
        return out[: inputs.num_seqs]

    monkeypatch.setattr(graphs, "run", checked_run)
    params = SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True)
    p = prompts(llm)
    llm.generate(p[:7], params)  # 7 sequences: bucket 8 with one padded row
    llm.generate(p[7:], params)  # 1 sequence: bucket 1
    assert len(steps) == 2 * 128
    assert not mismatches, f"graph replay differs from raw forward at steps {mismatches[:5]}"


@pytest.mark.parametrize("bucket", [1, 8])
def test_compiled_decode_drift(llm, bucket):
    modes = DecodeModes(llm.engine, bucket)
    assert "compiled" in modes.modes, "decode compile did not build on CUDA"
    p = prompts(llm)
    tf = teacher_forced(modes, p, steps=128, reference="graph")
    fr = free_running(modes, p, steps=128, reference="graph")
    report(f"drift_bucket{bucket}", {"teacher_forced": as_dicts(tf), "free_running": as_dicts(fr)})
    compiled = next(r for r in tf if r.mode == "compiled")
    assert compiled.top1_agreement >= 0.995, compiled


def test_no_recompile_after_warmup(smollm2_gguf):
    from torch._dynamo.utils import counters

    llm = LLM(str(smollm2_gguf), dtype="bfloat16", device="cuda", max_num_seqs=4, cudagraph_capture_sizes=(1, 2, 4),
              decode_compile=True, show_progress=False, max_model_len=512, num_kv_blocks=256)
    assert llm.engine.executor.graphs.compiled
    before = dict(counters["stats"])
    outs = llm.generate(["Hello there", "The sea is", "One, two,"], SamplingParams(temperature=0.0, max_tokens=32))
    assert all(o.outputs[0].token_ids for o in outs)
    assert dict(counters["stats"]) == before, "something compiled after warm-up"
