"""Which fusible ops run their PyTorch form instead of their opaque custom op.

Layers ask ``use_native("rms_norm")`` at call (or trace) time. Only the
compiled decode forward turns this on, around its calls, so that Inductor
traces the PyTorch form and fuses it with the surrounding glue; everything
else (prefill, eager, graphs without compile) sees the empty set and calls
``torch.ops.ingot.*``. A plain module global, not a thread-local: Dynamo
guards on it, and the compiled callable always sets the same value.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

_NATIVE: frozenset[str] = frozenset()


def use_native(op: str) -> bool:
    return op in _NATIVE


@contextlib.contextmanager
def native_ops(ops: Iterable[str]) -> Iterator[None]:
    """Run the block with ``ops`` in their PyTorch form."""
    global _NATIVE
    saved = _NATIVE
    _NATIVE = frozenset(ops)
    try:
        yield
    finally:
        _NATIVE = saved
