"""The harness of the interpreter tests (tests/ops/test_*_interpret.py): the Triton kernels
run on CPU through the Triton interpreter, against the references.

Opt-in (CI installs no Triton): ``INGOT_TEST_TRITON_INTERPRET=1 pytest
tests/ops/test_triton_interpret.py`` with ``triton`` installed (``make test`` runs every
interpreter file). Importing this module sets ``TRITON_INTERPRET=1``, and the fixtures import
the kernel modules afresh, so the ``@triton.jit`` functions become interpreted ones; small
shapes keep it quick. Each test file imports ``ENABLED`` and the fixtures it uses from here.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import replace

import pytest
import torch

ENABLED = os.environ.get("INGOT_TEST_TRITON_INTERPRET") == "1"

KERNEL_MODULES = (
    "softcap", "rounding", "activation", "decode_attention", "kv_store", "prefill_attention", "prefill_dispatch", "rms_norm", "rotary",
    "skinny_gemm", "quant_tiles", "quant_gemm", "int_linear", "fp8_linear", "fused_moe_quant", "mla_attention",
)


def _numpy_compat() -> None:
    """Triton 3.6's interpreter turns 1-element arrays into ints with int(array),
    which NumPy >= 2.4 refuses; use .item() instead (test-only patch)."""
    from triton.runtime import interpreter as interp

    scope = getattr(interp, "_LangPatchScope", None)
    if scope is None or getattr(scope.set_attr, "_ingot_compat", False):
        return
    original = scope.set_attr

    def set_attr(self, obj, name, value):
        if name == "__index__":
            value = lambda t: int(t.handle.data.item())  # noqa: E731
        return original(self, obj, name, value)

    set_attr._ingot_compat = True
    scope.set_attr = set_attr


class PoisonTorch:
    """``torch`` for the kernel modules, whose new tensors come pre-filled with
    NaN (floats) or junk (ints), so an element a kernel fails to write fails."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -77)

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


if ENABLED and "triton" not in sys.modules:
    # must precede the first import of triton: its own @jit helpers (tl.cdiv, ...)
    # become interpreted functions only if the variable is set by then
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def K():
    """The kernel modules, imported afresh under TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if os.environ.get("TRITON_INTERPRET") != "1" or not isinstance(standard.cdiv, InterpretedFunction):
        pytest.skip("triton was imported before interpreter mode was set: run this file in its own pytest process")
    _numpy_compat()
    mods = {}
    for name in KERNEL_MODULES:
        full = f"ingot.ops.triton.{name}"
        mod = sys.modules.get(full)
        mods[name] = importlib.reload(mod) if mod is not None else importlib.import_module(full)
    saved_torch = {name: mod.torch for name, mod in mods.items() if hasattr(mod, "torch")}
    for name in saved_torch:
        mods[name].torch = PoisonTorch()  # outputs and scratch start as NaN / junk
    yield type("Kernels", (), mods)
    for name, saved in saved_torch.items():
        mods[name].torch = saved
    import ingot.ops.triton as package

    for name in KERNEL_MODULES:  # interpreted kernels must not leak into other modules
        sys.modules.pop(f"ingot.ops.triton.{name}", None)
        package.__dict__.pop(name, None)


def skinny_config(K, m, n, k, prologue=0, router=False, **fields):
    """The default launch configuration with small K tiles (so short rows still split) and ``fields``."""
    return replace(K.skinny_gemm.launch_config(m, n, k, torch.device("cpu"), prologue, router), block_k=32, **fields)


# fused_moe has a fixture of its own (the module imported afresh and poisoned like the
# others), so its cases stand apart from the kernel list above
@pytest.fixture(scope="module")
def MOE(K):
    import importlib

    name = "ingot.ops.triton.fused_moe"
    mod = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    saved, mod.torch = mod.torch, PoisonTorch()
    yield mod
    mod.torch = saved
    sys.modules.pop(name, None)
    import ingot.ops.triton as package

    package.__dict__.pop("fused_moe", None)
