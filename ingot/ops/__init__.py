"""ingot's ops: ``torch.ops.ingot.*`` (library.py), PyTorch references
(reference.py), CUDA kernels (triton/), and the native-form policy (policy.py)."""

from ingot.ops import library  # noqa: F401  (registers torch.ops.ingot.*)
from ingot.ops.policy import native_ops, use_native

__all__ = ["native_ops", "use_native"]
