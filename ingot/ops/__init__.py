"""ingot's ops: ``torch.ops.ingot.*`` (library.py), PyTorch references
(reference.py) and CUDA kernels (triton/)."""

from ingot.ops import library  # noqa: F401  (registers torch.ops.ingot.*)
