"""A real Inductor compile of a tiny MoE model's decode step on CPU (the compile tests' pattern).

The routing glue (router GEMM, softmax, top-k, renormalisation, casts) is what Inductor
compiles; the experts must stay one opaque ``ingot.fused_moe`` node per sparse layer, with
no graph break, and the compiled step must equal the raw one.
"""

from __future__ import annotations

import pytest
import torch

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.layers.policy import OpPolicy
from ingot.models.moe import MoEBlock
from ingot.runner import compile_stats as cs
from ingot.runner import decode_compile
from ingot.runner.graph_runner import StaticBuffers, make_decode_forward
from tests.helpers import write_tiny_checkpoint


@pytest.mark.parametrize("skinny", [False, True], ids=["batch4", "batch1_skinny"])
def test_compiled_moe_decode_step_keeps_fused_moe_opaque(tmp_path, skinny):
    """On the skinny path (one row) the block's norm and router ride in o_proj's GEMV: one opaque
    ``ingot.linear_norm_linear_scaled`` per sparse layer, whose rstd the experts take."""
    path = write_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False, num_kv_blocks=64,
                       decode_compile=True)
    engine = Engine(cfg)
    model = engine.executor.model
    sparse_layers = sum(isinstance(layer.mlp, MoEBlock) for layer in model.layers)
    assert sparse_layers == 2

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):  # Inductor, recording what Dynamo hands it
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    batch = 1 if skinny else 4
    raw = make_decode_forward(model, OpPolicy(skinny_rows=1) if skinny else engine.executor.policy)
    compiled = decode_compile.build_decode_forward(raw, cfg, torch.device("cpu"), backend=backend, allow_cpu=True)
    assert getattr(compiled, "compiled", False)
    buf = StaticBuffers.allocate(4, 8, torch.device("cpu"))
    buf.input_ids.copy_(torch.tensor([5, 9, 13, 17]))
    buf.positions.zero_()
    buf.slot_mapping.copy_(torch.tensor([16, 32, 48, 64]))  # blocks 1..4, offset 0
    buf.block_tables[:, 0] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    snap = cs.stats_snapshot()
    with torch.inference_mode():
        expected = raw(*buf.view(batch)).clone()
        got = compiled(*buf.view(batch))
    stats = cs.stats_since(snap)
    assert stats.graph_breaks == 0, stats.describe()
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")]
    assert sum("ingot.fused_moe" in t for t in targets) == sparse_layers
    assert sum("ingot.linear_norm_linear_scaled" in t for t in targets) == (sparse_layers if skinny else 0)
    assert not any("ingot.rms_norm_linear_scaled" in t for t in targets)
    # the reference's host loop (unique, where, index_add) was not traced into the graph
    assert not any(op in t for t in targets for op in ("unique", "nonzero", "index_add", "where"))
    # the routing is compiled, its top-k as rounds of max-and-mask (one fused kernel on CUDA)
    assert any("softmax" in t for t in targets) and any("max" in t for t in targets)
    assert not any("topk" in t for t in targets)
    # the renormalisation divides by the values added up round by round: no reduction over k
    assert "sum" not in targets and any("truediv" in t for t in targets)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_select_topk_equals_torch_topk():
    """Values and ids of ``select_topk`` equal torch.topk's (largest first) on rows without ties;
    renormalised and cast, the values are HF's ``topk / topk.sum()`` up to the order of an fp32 sum."""
    from ingot.models.moe import select_topk

    gen = torch.Generator().manual_seed(0)
    for experts, k in ((8, 1), (8, 2), (60, 4), (64, 8), (128, 8)):
        logits = torch.randn(33, experts, generator=gen)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        want_v, want_i = torch.topk(probs, k, dim=-1)
        got_v, got_i = select_topk(probs, k)
        assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v)
        got_w, got_i = select_topk(probs, k, normalize=True)
        assert torch.equal(got_i, want_i)
        torch.testing.assert_close(got_w, want_v / want_v.sum(dim=-1, keepdim=True), rtol=1e-6, atol=0)
        got_w, _ = select_topk(probs, k, normalize=True, out_dtype=torch.bfloat16)
        assert got_w.dtype == torch.bfloat16
        torch.testing.assert_close(got_w, (want_v / want_v.sum(dim=-1, keepdim=True)).bfloat16(), rtol=8e-3, atol=0)
