"""ingot.runner.decode_compile's builder (CPU): when it compiles, with what, custom ops kept
opaque, one graph for the batch buckets, no recompiles, and the decode and verify forwards of a
tiny model compiled apart. Options: test_compile_options.py; process setup:
test_decode_compile_process.py; stats: test_compile_stats.py."""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo.config as dynamo_config

from ingot.config import EngineConfig
from ingot.runner import compile_options as co
from ingot.runner import compile_stats as cs
from ingot.runner import decode_compile as dc
from tests.runner.compile_fixtures import clean_state, f_add  # noqa: F401  (clean_state: autouse)


def test_disabled_returns_same_object():
    assert dc.build_decode_forward(f_add, EngineConfig(), torch.device("cpu")) is f_add
    assert dc.build_decode_forward(f_add, EngineConfig(), "cuda") is f_add
    assert not getattr(f_add, "compiled", False)


def test_cpu_without_allow_cpu_is_raw(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled"))
    cfg = EngineConfig(decode_compile=True)
    assert dc.build_decode_forward(f_add, cfg, torch.device("cpu")) is f_add
    assert dc.build_decode_forward(f_add, cfg, "cpu", backend="eager") is f_add


def test_compile_call_arguments(monkeypatch):
    import torch._inductor.config as inductor_config

    seen = {}

    def fake_compile(fn, **kwargs):
        seen.clear()  # the last call: the decode forward's (the op fallbacks may compile first)
        seen.update(kwargs, fn=fn)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    cfg = EngineConfig(decode_compile=True)
    fwd = dc.build_decode_forward(f_add, cfg, "cuda")  # device type only: nothing runs on it
    assert seen == {"fn": f_add, "fullgraph": False, "backend": "inductor", "options": co.inductor_options(inductor_config)}
    assert fwd.compiled is True and fwd.raw is f_add
    assert fwd.__name__ == "f_add"
    assert dc.build_decode_forward(fwd, cfg, "cuda") is fwd  # never wrapped twice
    assert dynamo_config.recompile_limit == 1024  # configure_process ran


def rms_forward(x, w):
    h = torch.ops.ingot.rms_norm(x * 2.0, w, 1e-6)
    return h + 1.0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_custom_op_no_graph_breaks(backend):
    x, w = torch.randn(3, 16), torch.rand(16) + 0.5
    cfg = EngineConfig(decode_compile=True, compile_native_ops=())
    fwd = dc.build_decode_forward(rms_forward, cfg, "cpu", backend=backend, allow_cpu=True)
    assert fwd.compiled is True and fwd.raw is rms_forward
    snap = cs.stats_snapshot()
    out = fwd(x, w)
    stats = cs.stats_since(snap)
    torch.testing.assert_close(out, rms_forward(x, w))
    assert stats.graph_breaks == 0, stats.describe()
    assert stats.recompiles == 0
    assert stats.graphs == 1 and stats.frames == 1
    assert stats.compile_seconds is not None and stats.compile_seconds > 0


def test_custom_op_stays_one_opaque_node():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    cfg = EngineConfig(decode_compile=True, compile_native_ops=())
    fwd = dc.build_decode_forward(rms_forward, cfg, "cpu", backend=record, allow_cpu=True)
    fwd(torch.randn(2, 8), torch.ones(8))
    assert len(graphs) == 1
    assert "ingot.rms_norm" in str(graphs[0].graph)


def step_like(ids, table):
    """A decode step's shape pattern: per-row inputs [B], a table [B, M] of fixed width."""
    return (table.float().sum(1) + ids.float()) * 2.0


def test_dynamic_batch_compiles_once_for_all_buckets():
    """Buckets captured largest first: static 32, then one symbolic-batch graph for
    24, 16 and 8, and batch 1 specialized."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    cfg = EngineConfig(decode_compile=True)
    fwd = dc.build_decode_forward(step_like, cfg, "cpu", backend=record, allow_cpu=True)
    for b in (32, 24, 16, 8, 1):
        ids, table = torch.arange(b), torch.ones(b, 7, dtype=torch.int32)
        torch.testing.assert_close(fwd(ids, table), step_like(ids, table))
        with dc.forbid_recompiles():  # what capture does right after each bucket's warm-up
            fwd(ids, table)
    assert len(graphs) == 3


class PolicyRecorder(torch.nn.Module):
    """A stand-in model that records the OpPolicy each forward hands its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, input_ids, positions, meta, policy):
        self.seen.append(policy)
        return input_ids.float()[:, None]

    def compute_logits(self, hidden, policy):
        return hidden


def test_compiled_forward_gets_the_native_policy_and_raw_keeps_its_own(monkeypatch):
    """The graph runner builds the forward it compiles with ``compile_native_ops`` native,
    and keeps the runner's policy (skinny rows included) for the raw forward."""
    from ingot.layers.policy import OpPolicy
    from ingot.runner import graph_runner

    handed = []

    def fake_build(forward, config, device):
        handed.append(forward)
        wrapped = lambda *a: forward(*a)  # noqa: E731
        wrapped.compiled = True
        return wrapped

    monkeypatch.setattr(graph_runner.decode_compile, "build_decode_forward", fake_build)
    model = PolicyRecorder()
    cfg = EngineConfig(decode_compile=True, compile_native_ops=("rms_norm", "silu_and_mul"),
                       cudagraph_capture_sizes=(2,), max_num_seqs=2, show_progress=False)
    base = OpPolicy(skinny_rows=1)
    runner = graph_runner.DecodeGraphRunner(model, cfg, torch.device("cpu"), 4, base)
    args = runner.buffers.view(2)
    runner.forward(*args)
    assert model.seen[-1] == OpPolicy(skinny_rows=1, native=frozenset({"rms_norm", "silu_and_mul"}))
    runner.raw_forward(*args)
    assert model.seen[-1] == base and not base.native
    assert len(handed) == 1


def test_repeated_calls_do_not_recompile():
    x, w = torch.randn(2, 8), torch.ones(8)
    fwd = dc.build_decode_forward(rms_forward, EngineConfig(decode_compile=True), "cpu", backend="eager", allow_cpu=True)
    fwd(x, w)
    with dc.forbid_recompiles():  # the guards hold call after call
        for _ in range(3):
            fwd(x, w)


def test_forbid_recompiles_raises_on_new_shape():
    fwd = dc.build_decode_forward(f_add, EngineConfig(decode_compile=True), "cpu", backend="eager", allow_cpu=True)
    fwd(torch.ones(4))
    with dc.forbid_recompiles():
        fwd(torch.ones(4))  # cached: fine
        with pytest.raises(Exception, match="(?i)recompil"):
            fwd(torch.ones(5))
    fwd(torch.ones(6))  # allowed again outside


def test_batch1_step_compiles_with_the_skinny_ops(tmp_path):
    """With the skinny path on (as the raw decode graphs run batch 1), the compiled step
    traces without graph breaks, keeps the skinny GEMVs and their fused prologues as
    opaque nodes, like the raw step runs them, and equals the raw step."""
    from ingot.engine.engine import Engine
    from ingot.layers.policy import OpPolicy
    from ingot.runner.graph_runner import StaticBuffers, make_decode_forward
    from tests.helpers import OpNames, write_tiny_checkpoint

    graphs = []

    def record_aot(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: g.forward)(gm, example_inputs)

    path = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False, decode_compile=True)
    engine = Engine(cfg)
    raw = make_decode_forward(engine.executor.model, OpPolicy(skinny_rows=1))
    buf = StaticBuffers.allocate(1, 8, torch.device("cpu"))
    buf.input_ids.copy_(torch.tensor([7]))
    buf.slot_mapping.copy_(torch.tensor([16]))
    buf.block_tables[0, 0] = 1
    fwd = dc.build_decode_forward(raw, cfg, "cpu", backend=record_aot, allow_cpu=True)
    with torch.inference_mode():
        with OpNames() as ran:
            expected = raw(*buf.view(1)).clone()
        snap = cs.stats_snapshot()
        got = fwd(*buf.view(1))
        stats = cs.stats_since(snap)
    assert {"ingot.rms_norm_linear", "ingot.silu_mul_linear"} <= ran.names
    torch.testing.assert_close(got, expected)
    assert stats.graph_breaks == 0, stats.describe()
    source = "\n".join(str(g.graph) for g in graphs)
    assert "ingot.decode_attention" in source  # the opaque kernels stay
    assert all(op in source for op in ("ingot.skinny_linear", "ingot.rms_norm_linear", "ingot.silu_mul_linear"))


def test_decode_and_verify_forwards_compile_apart(tmp_path):
    """The verify forward (``store_first``: rows that read each other's K/V) is a function of its
    own, so torch.compile traces it apart from the decode forward: each compiles once, the
    decode graph calls the fused decode op, the verify graph stores K/V then attends, and a
    further call of either recompiles nothing."""
    from ingot.engine.engine import Engine
    from ingot.runner.graph_runner import StaticBuffers, make_decode_forward
    from tests.helpers import write_tiny_checkpoint

    graphs = []

    def record_aot(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: g.forward)(gm, example_inputs)

    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False, decode_compile=True)
    engine = Engine(cfg)
    model, policy = engine.executor.model, engine.executor.policy
    buf = StaticBuffers.allocate(2, 8, torch.device("cpu"))  # one sequence's rows at positions 0 and 1
    buf.input_ids.copy_(torch.tensor([7, 9]))
    buf.positions.copy_(torch.tensor([0, 1]))
    buf.slot_mapping.copy_(torch.tensor([16, 17]))
    buf.block_tables[:, 0] = 1
    buf.seq_lens.copy_(torch.tensor([1, 2]))
    forwards = {kind: make_decode_forward(model, policy, store_first=kind == "verify") for kind in ("decode", "verify")}
    compiled = {kind: dc.build_decode_forward(f, cfg, "cpu", backend=record_aot, allow_cpu=True) for kind, f in forwards.items()}
    with torch.inference_mode():
        expected = forwards["verify"](*buf.view(2)).clone()
        got = {kind: compiled[kind](*buf.view(2)).clone() for kind in ("decode", "verify")}
        with dc.forbid_recompiles():
            torch.testing.assert_close(compiled["verify"](*buf.view(2)), expected)
            compiled["decode"](*buf.view(2))
    assert len(graphs) == 2
    decode_src, verify_src = (str(g.graph) for g in graphs)
    assert "ingot.decode_attention_rope" in decode_src and "ingot.store_kv" not in decode_src
    assert "ingot.decode_attention_rope" not in verify_src
    assert "ingot.store_kv" in verify_src and re.search(r"ingot\.decode_attention\b", verify_src)
    torch.testing.assert_close(got["verify"], expected)
