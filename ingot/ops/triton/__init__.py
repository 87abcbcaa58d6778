"""CUDA (Triton) kernels for torch.ops.ingot.* — registered lazily on CUDA.

Until the kernels land, CUDA runs the PyTorch reference implementations.
``register_cuda_kernels()`` is the single hook the engine calls on CUDA.
"""


def register_cuda_kernels() -> bool:
    """Register Triton kernels as the CUDA dispatch of the ingot ops; False if none."""
    return False
