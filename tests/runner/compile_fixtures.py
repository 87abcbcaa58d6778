"""Shared by the decode-compile tests (CPU): a fresh Dynamo and module state around every test
(``clean_state``, autouse in each file that imports it) and a trivial forward to compile."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.config as dynamo_config
from torch._dynamo import trace_rules

import ingot.ops  # noqa: F401  (registers torch.ops.ingot.*)
from ingot.runner import compile_options as co
from ingot.runner import decode_compile as dc

REAL_ADD = trace_rules.add
CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


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


def f_add(x):
    return x * 2 + 1
