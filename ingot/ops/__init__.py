"""ingot's ops: each declared once with its PyTorch reference (reference.py), made
``torch.ops.ingot.*`` in library.py, with CUDA kernels in triton/."""

from ingot.ops import library  # noqa: F401  (registers torch.ops.ingot.*)
