"""CUDA (Triton) kernels for torch.ops.ingot.* — registered lazily on CUDA.

``register_cuda_kernels()`` is the single hook the engine calls on CUDA: it
registers each kernel as the CUDA implementation of its op
(``op.register_kernel("cuda")``), once. Triton is imported only there, so CPU
installs never import it; without CUDA or without Triton the ops keep running
the PyTorch references. ``EngineConfig.triton_kernels=False`` (``INGOT_TRITON_KERNELS=0``)
keeps the references too, for debugging a suspected kernel: registration is
process-wide, so it applies from the first engine of the process.

Each kernel module marks its op implementations with ``@cuda_kernel`` (``_common``);
``register_cuda_kernels`` imports every module of this package (no list to extend) and
registers what they marked. A kernel takes its op's arguments in the op's order, plus
optional ones for sweeps and tests (``config``: a frozen launch configuration, which
the tuned modules otherwise pick with ``launch_config(...)`` from shapes and device).
prefill_dispatch.py is the prefill op's CUDA implementation: it picks, from shapes, the
fused prefill kernel or PyTorch's flash / cuDNN attention paired with the context kernel.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil

log = logging.getLogger(__name__)
_registered = False


def triton_available() -> bool:
    """Whether Triton can be imported (imports it: call only where CUDA is present)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def register_cuda_kernels() -> bool:
    """Register Triton kernels as the CUDA dispatch of the ingot ops; False if none.

    Idempotent. Returns False (and imports nothing) without a CUDA device or
    when Triton is not installed.
    """
    global _registered
    if _registered:
        return True
    import torch

    if not torch.cuda.is_available():
        return False
    if not triton_available():
        return False

    from ingot.ops import library
    from ingot.ops.triton import _common, activation

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")

    try:  # one tiny kernel: a broken toolchain (no C compiler for the launcher, ...) shows here
        x = torch.ones(2, 32, device="cuda")
        torch.cuda.synchronize()
        if not torch.allclose(activation.silu_and_mul(x).cpu(), torch.nn.functional.silu(torch.ones(2, 16))):
            raise RuntimeError("wrong result from the smoke-test kernel")
    except Exception as exc:  # keep serving on the references rather than failing later
        log.warning("Triton kernels unavailable, using the PyTorch reference ops: %s", exc)
        return False

    for name, kernel in _common.CUDA_KERNELS.items():
        library.OPS[name].register_kernel("cuda")(kernel)
    _registered = True
    return True
