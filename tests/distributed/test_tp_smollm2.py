"""SmolLM2-135M (9 query heads, 3 KV heads) over three CPU ranks: greedy tokens equal one rank's."""

from __future__ import annotations

from ingot import LLM, SamplingParams
from tests.distributed.tp_helpers import alive

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import torch\nimport numpy as np\n",
    "My favourite recipe for pancakes",
    "In 1969, the first humans",
    "The quick brown fox",
]


def test_smollm2_tp3_greedy_tokens_equal_tp1(smollm2_gguf):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for size in (1, 3):
        with LLM(str(smollm2_gguf), device="cpu", dtype="float32", tensor_parallel_size=size, max_num_seqs=8,
                 max_model_len=256, max_num_batched_tokens=512, show_progress=False) as llm:
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            pids = llm.engine.executor.workers.pids if size > 1 else []
        assert all(o.error is None for o in outputs)
        tokens[size] = [o.outputs[0].token_ids for o in outputs]
    assert all(len(t) == 48 for t in tokens[3])
    assert tokens[3] == tokens[1]
    assert len(pids) == 2 and not any(alive(p) for p in pids)
