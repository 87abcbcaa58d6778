"""ingot.runner.decode_compile's process setup (CPU): Dynamo limits, cache directories and skip
rules, once per process and again in each new thread."""

from __future__ import annotations

import os
import sys
import threading
import uuid

import torch
import torch._dynamo.config as dynamo_config
from torch._dynamo import trace_rules

from ingot.config import EngineConfig
from ingot.runner import compile_stats as cs
from ingot.runner import decode_compile as dc
from tests.runner.compile_fixtures import REAL_ADD
from tests.runner.compile_fixtures import clean_state  # noqa: F401  (autouse)


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
