"""The shallow pre-compile that creates Inductor's fallbacks for the ingot ops (runner/inductor_fallbacks.py)."""

from __future__ import annotations

import logging

import pytest
import torch

import ingot.ops.library as library
from ingot.config import EngineConfig
from ingot.runner import decode_compile as dc
from ingot.runner import inductor_fallbacks as fb
from tests.helpers import OpNames

NOT_IN_DECODE = {"ingot.prefill_attention", "ingot.mla_prefill_attention"}  # prefill never runs compiled


def _all_ops() -> set[str]:
    return {f"ingot.{name}" for name in library.OPS}


@pytest.fixture
def fresh():
    fb._reset_for_tests()
    yield
    fb._reset_for_tests()


@pytest.fixture
def no_fallbacks(fresh):
    """Inductor as if it never met the ingot ops (their lowerings removed, Dynamo reset)."""
    from torch._inductor.lowering import lowerings  # a peek at Inductor's table, for the tests only

    ops = [getattr(torch.ops.ingot, name.split(".")[1]).default for name in _all_ops() - NOT_IN_DECODE]
    saved = {op: lowerings.pop(op) for op in ops if op in lowerings}
    torch._dynamo.reset()
    yield lowerings, ops
    for op, fn in saved.items():
        lowerings.setdefault(op, fn)
    torch._dynamo.reset()


def test_every_decode_op_is_called():
    """A new decode op must be added to _call_every_op, or a deep first use can hang 2.11."""
    with torch.no_grad(), OpNames() as ran:
        fb._call_every_op(*fb._example_inputs())
    assert _all_ops() - NOT_IN_DECODE <= ran.names
    assert len(_all_ops()) >= 10  # the enumeration itself found the library


def test_registers_the_fallbacks_once(no_fallbacks):
    lowerings, ops = no_fallbacks
    assert fb.register_op_fallbacks() is True
    assert [op for op in ops if op not in lowerings] == []
    assert fb.register_op_fallbacks() is False  # once per process


def test_registers_even_when_the_compile_cache_has_the_function(no_fallbacks):
    """A cache hit would skip the lowering (and so the fallbacks): the caches are off for it."""
    lowerings, ops = no_fallbacks
    with torch.no_grad():
        torch.compile(fb._call_every_op, backend="inductor", fullgraph=True, dynamic=False)(*fb._example_inputs())
    for op in ops:  # forget what that compile made; its artifact stays in the caches
        lowerings.pop(op, None)
    torch._dynamo.reset()
    assert fb.register_op_fallbacks() is True
    assert [op for op in ops if op not in lowerings] == []


def test_a_failure_is_logged_not_raised(fresh, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(fb.torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger=fb.log.name):
        assert fb.register_op_fallbacks() is True
    assert "no compiler here" in caplog.text


@pytest.mark.parametrize("backend,called", [("inductor", True), ("aot_eager", False)])
def test_build_registers_for_inductor_only(monkeypatch, backend, called):
    calls = []
    monkeypatch.setattr(dc.inductor_fallbacks, "register_op_fallbacks", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(dc.torch, "compile", lambda fn, **k: fn)  # building only, nothing compiles
    cfg = EngineConfig(decode_compile=True)
    fwd = dc.build_decode_forward(lambda *a: None, cfg, "cpu", backend=backend, allow_cpu=True)
    assert fwd.compiled
    assert bool(calls) is called
