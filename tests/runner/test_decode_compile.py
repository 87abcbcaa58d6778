"""ingot.runner.decode_compile: options per PyTorch version, process setup, the builder, stats (CPU)."""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
import torch._dynamo.config as dynamo_config
import torch._dynamo.utils as dynamo_utils
from torch._dynamo import trace_rules

import ingot.ops  # noqa: F401  (registers torch.ops.ingot.*)
from ingot.config import EngineConfig
from ingot.runner import compile_options as co
from ingot.runner import compile_stats as cs
from ingot.runner import decode_compile as dc

LOGGER = "ingot.runner.decode_compile"
REAL_ADD = trace_rules.add
CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def ns(**kw) -> SimpleNamespace:
    return SimpleNamespace(**kw)


def resolve(config, dotted: str):
    return functools.reduce(getattr, dotted.split("."), config)


def fake_inductor(version: str) -> SimpleNamespace:
    """Namespaces shaped like torch._inductor.config of a PyTorch release (only the names we touch)."""
    cfg = ns(triton=ns(cudagraphs=True, cudagraph_trees=True), fallback_random=False, emulate_precision_casts=False)
    if version == "2.10":
        cfg.emulate_divison_rounding = False
        cfg.deterministic = False
    elif version == "2.11":
        cfg.eager_numerics = ns(division_rounding=False)
        cfg.deterministic = False
        cfg.triton.enable_pdl = False
    elif version == "2.14":
        cfg.eager_numerics = ns(division_rounding=False, disable_ftz=False, use_pytorch_libdevice=False)
        cfg.deterministic = False
        cfg.triton.enable_pdl = False
    return cfg


@pytest.fixture(autouse=True)
def clean_state(monkeypatch, tmp_path):
    """Fresh Dynamo and module state, limits restored, cache vars absent, skip rules recorded only."""
    torch._dynamo.reset()
    dc._reset_for_tests()
    # config.patch restores the limits exactly (monkeypatch's undo would delete, i.e. hide, them)
    limits = dynamo_config.patch({n: getattr(dynamo_config, n) for n in co.dynamo_limit_names(dynamo_config)})
    limits.__enter__()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for var in CACHE_VARS:
        monkeypatch.setenv(var, "x")  # recorded, so whatever configure_process sets is undone
        monkeypatch.delenv(var)
    calls: list[str] = []
    monkeypatch.setattr(trace_rules, "add", calls.append)
    yield calls
    limits.__exit__(None, None, None)
    torch._dynamo.reset()
    dc._reset_for_tests()


# ------------------------------------------------------------ inductor_options


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.8", {"triton.cudagraphs": False, "emulate_precision_casts": True}),
        ("2.10", {"triton.cudagraphs": False, "emulate_precision_casts": True, "emulate_divison_rounding": True}),
        ("2.11", {"triton.cudagraphs": False, "emulate_precision_casts": True, "triton.enable_pdl": True,
                  "eager_numerics.division_rounding": True}),
        ("2.14", {"triton.cudagraphs": False, "emulate_precision_casts": True, "triton.enable_pdl": True,
                  "eager_numerics.division_rounding": True}),
    ],
)
def test_inductor_options_per_version(version, expected):
    cfg = fake_inductor(version)
    opts = co.inductor_options(cfg)
    assert opts == expected
    for key in opts:  # never a key the config lacks
        resolve(cfg, key)


def test_inductor_options_prefers_new_division_name_and_drops_unknowns():
    both = ns(emulate_divison_rounding=False, eager_numerics=ns(division_rounding=False))
    assert co.inductor_options(both) == {"eager_numerics.division_rounding": True}
    assert co.inductor_options(ns()) == {}
    # a sub-config without the leaf
    assert co.inductor_options(ns(triton=ns(), eager_numerics=ns())) == {}


def test_has_option_dotted():
    cfg = fake_inductor("2.14")
    assert co.has_option(cfg, "triton.cudagraphs")
    assert co.has_option(cfg, "eager_numerics.disable_ftz")
    assert not co.has_option(cfg, "eager_numerics.nope")
    assert not co.has_option(cfg, "nope.cudagraphs")


def test_inductor_options_real_config_resolve():
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    opts = co.inductor_options(inductor_config)
    assert opts["triton.cudagraphs"] is False
    for key in opts:
        resolve(inductor_config, key)
        assert key in known, key
    # Inductor validates options when torch.compile is called (no compile happens here)
    torch.compile(lambda x: x, backend="inductor", options=opts, dynamic=False)


def test_inductor_options_real_compile_on_cpu():
    """One real Inductor compile with every option this torch has (a matmul: no C++ kernel to build)."""
    import torch._inductor.config as inductor_config

    opts = co.inductor_options(inductor_config)
    fn = torch.compile(lambda a, b: a @ b, backend="inductor", options=opts, dynamic=False, fullgraph=True)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    torch.testing.assert_close(fn(a, b), a @ b)


# ------------------------------------------------------------ dynamo limits


def test_dynamo_limit_names():
    assert co.dynamo_limit_names(ns(recompile_limit=8, accumulated_recompile_limit=256)) == (
        "recompile_limit", "accumulated_recompile_limit")
    assert co.dynamo_limit_names(ns(recompile_limit=8)) == ("recompile_limit",)
    assert co.dynamo_limit_names(ns()) == ()
    assert co.dynamo_limit_names(dynamo_config) == ("recompile_limit", "accumulated_recompile_limit")


# ------------------------------------------------------------ configure_process


def test_configure_process_once(monkeypatch, clean_state, tmp_path):
    counts = {"limits": 0, "dirs": 0}

    def counting(key, fn):
        def wrapper(*a, **k):
            counts[key] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(dc, "_raise_dynamo_limits", counting("limits", dc._raise_dynamo_limits))
    monkeypatch.setattr(dc, "_set_cache_dirs", counting("dirs", dc._set_cache_dirs))
    monkeypatch.setattr(dc, "SKIP_MODULES", ("json", "ingot_no_such_module_xyz", "json"))
    dc.configure_process()
    dc.configure_process()
    assert counts == {"limits": 1, "dirs": 1}
    assert dynamo_config.recompile_limit == 1024
    assert dynamo_config.accumulated_recompile_limit == 1024
    assert clean_state == ["json"]  # importable ones only, once
    base = tmp_path / "xdg" / "ingot"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(base / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(base / "triton")


def test_configure_process_keeps_existing_env_and_higher_limits(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    dynamo_config.recompile_limit = 4096  # the fixture restores it
    dc.configure_process()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home" / ".cache" / "ingot" / "triton")
    assert dynamo_config.recompile_limit == 4096  # raised, never lowered
    assert dynamo_config.accumulated_recompile_limit == 1024


def test_configure_process_replaces_inductors_own_defaults(monkeypatch, tmp_path):
    """Importing torch._inductor writes its default dir into the variable: that is not the user's choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default)
    monkeypatch.setenv("TRITON_CACHE_DIR", os.path.join(default, "triton", "0"))
    dc.configure_process()
    base = tmp_path / "xdg" / "ingot"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(base / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(base / "triton")


def test_configure_process_per_thread():
    """On PyTorch >= 2.12 config assignments are per thread: a new thread configures itself."""
    dc.configure_process()
    seen = {}

    def worker():
        seen["before"] = dynamo_config.recompile_limit
        dc.configure_process()
        seen["after"] = dynamo_config.recompile_limit

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["after"] == 1024
    if dc._config_is_thread_local():
        assert seen["before"] != 1024
    assert dynamo_config.recompile_limit == 1024


def test_compiled_wrapper_configures_a_new_thread():
    fwd = dc.build_decode_forward(lambda x: x + 1, EngineConfig(decode_compile=True), "cpu", backend="eager", allow_cpu=True)
    seen = {}

    def worker():
        seen["out"] = fwd(torch.ones(3))
        seen["limit"] = dynamo_config.recompile_limit

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert torch.equal(seen["out"], torch.full((3,), 2.0))
    assert seen["limit"] == 1024


def test_real_skip_rule_makes_dynamo_skip_the_module(monkeypatch, tmp_path):
    """A module in SKIP_MODULES runs outside the compiled graph."""
    name = f"ingot_skip_probe_{uuid.uuid4().hex[:8]}"
    path = tmp_path / "mods" / f"{name}.py"
    path.parent.mkdir()
    path.write_text("def helper(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.setattr(trace_rules, "add", REAL_ADD)
    dirs_before = list(trace_rules.SKIP_DIRS) if hasattr(trace_rules, "SKIP_DIRS") else None
    try:
        monkeypatch.setattr(dc, "SKIP_MODULES", (name,))
        dc.configure_process()
        assert name in dc._SKIPPED
        if hasattr(trace_rules, "check_file"):
            assert trace_rules.check_file(str(path)).skipped
        mod = __import__(name)

        def f(x):
            return mod.helper(x * 2) * 3

        snap = cs.stats_snapshot()
        out = torch.compile(f, backend="eager", dynamic=False)(torch.ones(2))
        stats = cs.stats_since(snap)
        assert torch.equal(out, torch.full((2,), 9.0))
        assert stats.graph_breaks >= 1  # the skipped function ran outside the graph
    finally:
        if dirs_before is not None:
            trace_rules.SKIP_DIRS[:] = dirs_before
            trace_rules._recompile_re()
        sys.modules.pop(name, None)


# ------------------------------------------------------------ builder


def f_add(x):
    return x * 2 + 1


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


# ------------------------------------------------------------ stats


def with_print(x):
    y = x * 2
    print("graph break here")
    return y + 1


def with_item(x):
    if (x.sum() > 0).item():
        return x + 1
    return x - 1


@pytest.mark.parametrize("fn", [with_print, with_item])
def test_stats_report_graph_breaks_with_reasons(fn, capsys):
    fwd = dc.build_decode_forward(fn, EngineConfig(decode_compile=True), "cpu", backend="eager", allow_cpu=True)
    snap = cs.stats_snapshot()
    out = fwd(torch.ones(3))
    stats = cs.stats_since(snap)
    assert torch.equal(out, fn(torch.ones(3)))
    assert stats.graph_breaks >= 1
    assert len(stats.graph_break_reasons) == stats.graph_breaks
    assert all(r for r in stats.graph_break_reasons)
    assert any(Path(__file__).name in r for r in stats.graph_break_reasons)  # where it broke
    text = stats.describe()
    assert "graph break" in text and "break x" in text
    # a second snapshot sees nothing new
    snap = cs.stats_snapshot()
    fwd(torch.ones(3))
    assert cs.stats_since(snap).graph_breaks == 0


def test_stats_report_recompiles_with_reasons():
    cfg = EngineConfig(decode_compile=True)
    fwd = dc.build_decode_forward(f_add, cfg, "cpu", backend="eager", allow_cpu=True)
    snap = cs.stats_snapshot()
    fwd(torch.ones(4))
    first = cs.stats_since(snap)
    assert (first.frames, first.recompiles) == (1, 0)
    snap = cs.stats_snapshot()
    fwd(torch.ones(5))  # recompiles with the size symbolic (automatic dynamic shapes) ...
    fwd(torch.ones(6))  # ... which this size reuses
    stats = cs.stats_since(snap)
    assert stats.recompiles == 1 and stats.frames == 1
    assert all(r.startswith("f_add:") for r in stats.recompile_reasons)
    assert any("size" in r for r in stats.recompile_reasons), stats.recompile_reasons
    assert stats.compile_seconds is not None and stats.compile_seconds > 0
    assert stats.wall_seconds >= stats.compile_seconds * 0.5
    assert "1 recompile(s)" in stats.describe()


def test_stats_from_compilation_metrics_records(monkeypatch):
    """Frame records count as frames (with recompile reasons); runtime records add compile time only."""

    def rec(**kw):
        base = dict(co_name="fwd", recompile_reason=None, is_runtime=False, duration_us=None, entire_frame_compile_time_s=None)
        return SimpleNamespace(**{**base, **kw})

    old = rec(duration_us=5_000_000)
    records = [old]
    monkeypatch.setattr(dynamo_utils, "get_compilation_metrics", lambda: list(records))
    snap = cs.stats_snapshot()
    records += [
        rec(duration_us=1_500_000, recompile_reason="0/0: tensor 'x' size mismatch at index 0. expected 4, actual 8"),
        rec(is_runtime=True, duration_us=250_000),
        rec(co_name="resume", entire_frame_compile_time_s=0.25),
    ]
    stats = cs.stats_since(snap)
    assert (stats.frames, stats.recompiles) == (2, 1)
    assert stats.recompile_reasons == ["fwd: 0/0: tensor 'x' size mismatch at index 0. expected 4, actual 8"]
    assert stats.compile_seconds == pytest.approx(2.0)


def test_stats_degrade_without_compilation_metrics(monkeypatch):
    monkeypatch.delattr(dynamo_utils, "get_compilation_metrics")
    monkeypatch.setattr(dynamo_utils, "graph_break_reasons", None)  # fall back to counters too
    fwd = dc.build_decode_forward(with_print, EngineConfig(decode_compile=True), "cpu", backend="eager", allow_cpu=True)
    fwd(torch.ones(2))
    snap = cs.stats_snapshot()
    fwd(torch.ones(3))
    stats = cs.stats_since(snap)
    assert stats.graph_breaks >= 1 and all(stats.graph_break_reasons)
    assert stats.recompiles >= 1  # guard failures: an upper bound
    assert stats.compile_seconds is not None


def test_stats_since_survives_dynamo_reset():
    fwd = dc.build_decode_forward(with_print, EngineConfig(decode_compile=True), "cpu", backend="eager", allow_cpu=True)
    fwd(torch.ones(2))
    snap = cs.stats_snapshot()
    torch._dynamo.reset()
    fwd(torch.ones(2))
    stats = cs.stats_since(snap)
    assert stats.graph_breaks >= 1 and stats.recompiles == 0


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
