"""A target's decode step compiled by Inductor (CPU) with an EAGLE-3 head attached: its hidden
rows (``fc`` of three layers' residual streams) are stored in place in the head's cache, equal
to the raw step's, and the compiled code allocates no copy of that cache."""

from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.runner import decode_compile
from ingot.runner.graph_runner import StaticBuffers, make_decode_forward
from tests.engine.eagle_heads import write_eagle3
from tests.helpers import write_tiny_checkpoint

BLOCKS = 777  # an unmistakable size in the generated code


def test_compiled_target_step_stores_the_hidden_rows_in_place(tmp_path):
    target = write_tiny_checkpoint(tmp_path / "llama", "llama", overrides={"vocab_size": 300, "num_hidden_layers": 8})
    head = write_eagle3(tmp_path / "eagle3", 300, draft_vocab=120)
    cfg = EngineConfig(model=str(target), dtype="float32", device="cpu", show_progress=False, num_kv_blocks=BLOCKS,
                       decode_compile=True, speculative_config={"method": "eagle3", "model": str(head),
                                                                "num_speculative_tokens": 3})
    engine = Engine(cfg)
    runner = engine.executor
    cache = runner.head.sink.cache
    raw = make_decode_forward(runner.model, runner.policy)
    compiled = decode_compile.build_decode_forward(raw, cfg, torch.device("cpu"), allow_cpu=True)
    assert getattr(compiled, "compiled", False)
    buf = StaticBuffers.allocate(4, 8, torch.device("cpu"))
    buf.input_ids.copy_(torch.tensor([5, 9, 13, 17]))
    buf.positions.copy_(torch.tensor([0, 0, 0, 0]))
    slots = torch.tensor([16, 32, 48, 64])
    buf.slot_mapping.copy_(slots)  # blocks 1..4, offset 0
    buf.block_tables[:, 0] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    with torch.inference_mode():
        cache.zero_()
        expected = raw(*buf.view(4)).clone()
        rows = cache[slots].clone()
        cache.zero_()
        got, code = run_and_get_code(compiled, *buf.view(4))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert rows.abs().min() > 0, "every row stored"
    torch.testing.assert_close(cache[slots], rows, rtol=1e-4, atol=1e-4)
    assert cache.abs().sum() == cache[slots].abs().sum(), "nothing stored elsewhere"
    assert f"empty_strided_cpu(({BLOCKS * 16}, " not in "\n".join(code), "the compiled step copies the hidden cache"
