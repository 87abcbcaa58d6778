"""One real Inductor compile of a tiny model's decode step on CPU.

Checks the compiled step matches the raw one, and that the KV cache is
mutated in place: no buffer of the cache's size appears in the generated code
(aliased cache inputs once made AOTAutograd clone the whole pool every step).
"""

from __future__ import annotations

import contextlib

import torch
from torch._inductor.utils import run_and_get_code

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.runner import decode_compile
from ingot.runner.graph_runner import StaticBuffers, make_decode_forward
from tests.helpers import write_tiny_checkpoint

BLOCKS = 777  # an unmistakable size in the generated code


def test_inductor_decode_step_in_place_and_close_to_raw(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False,
                       num_kv_blocks=BLOCKS, decode_compile=True)
    engine = Engine(cfg)
    raw = make_decode_forward(engine.executor.model, engine.executor.policy)
    compiled = decode_compile.build_decode_forward(raw, cfg, torch.device("cpu"), allow_cpu=True)
    assert getattr(compiled, "compiled", False)
    buf = StaticBuffers.allocate(4, 8, torch.device("cpu"))
    buf.input_ids.copy_(torch.tensor([5, 9, 13, 17]))
    buf.positions.copy_(torch.tensor([0, 0, 0, 0]))
    buf.slot_mapping.copy_(torch.tensor([16, 32, 48, 64]))  # blocks 1..4, offset 0
    buf.block_tables[:, 0] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    with torch.inference_mode():
        expected = raw(*buf.view(4)).clone()
        got, code = run_and_get_code(compiled, *buf.view(4))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    source = "\n".join(code)
    cache_alloc = f"empty_strided_cpu(({BLOCKS}, "
    assert cache_alloc not in source, "the compiled step allocates a copy of the KV cache"
    assert f"({BLOCKS}, 16, 2, 16)" in source, "the caches are inputs of the compiled graph"

    # the next buckets: one recompile with the batch dim symbolic, then reuse (Dynamo's
    # automatic dynamic shapes); still equal to raw. (Not through run_and_get_code: it resets Dynamo.)
    for size, may_compile in ((3, True), (2, False)):
        with torch.inference_mode():
            expected = raw(*buf.view(size)).clone()
            with contextlib.nullcontext() if may_compile else decode_compile.forbid_recompiles():
                got = compiled(*buf.view(size))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
