"""Dynamo traces the tensor-parallel decode forward whole: the functional all-reduces and the
lm_head's all-gather become nodes of one graph (what Inductor compiles and a CUDA graph captures)."""

from __future__ import annotations

import torch

from ingot.runner.step_inputs import host_step
from ingot.sampling_params import SamplingParams
from tests.distributed.tp_helpers import compile_decode_forward, tp_engine
from tests.helpers import write_tiny_checkpoint


def test_compiled_tp_decode_forward_is_one_graph_with_the_collectives(tmp_path):
    path = str(write_tiny_checkpoint(tmp_path / "qwen3", "qwen3"))
    engine = tp_engine(path, tensor_parallel_size=2, max_model_len=64)
    try:
        for prompt in ([5, 6, 7], [8, 9, 10, 11, 12]):
            engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()  # prefill: both sequences decode from here on
        batch = engine.scheduler.schedule()
        assert not batch.is_prefill
        # every rank compiles and runs its decode forward: the collectives pair up across ranks
        raw, compiled, graphs = engine.executor.run_on_ranks(compile_decode_forward, host_step(batch, engine.config.block_size))
    finally:
        engine.close()
    (targets,) = graphs  # fullgraph: one graph, no break
    layers = engine.model_config.num_layers
    assert sum("_c10d_functional.all_reduce" in t for t in targets) == 2 * layers + 1  # o_proj, down per layer; embedding
    assert sum("_c10d_functional.all_gather_into_tensor" in t for t in targets) == 1  # lm_head
    assert sum("_c10d_functional.wait_tensor" in t for t in targets) == 2 * layers + 2
    torch.testing.assert_close(compiled, raw, rtol=1e-5, atol=1e-5)
