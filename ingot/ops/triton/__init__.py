"""CUDA (Triton) kernels for torch.ops.ingot.* — registered lazily on CUDA.

``register_cuda_kernels()`` is the single hook the engine calls on CUDA: it
registers each kernel as the CUDA implementation of its op
(``op.register_kernel("cuda")``), once. Triton is imported only there, so CPU
installs never import it; without CUDA or without Triton the ops keep running
the PyTorch references. ``EngineConfig.triton_kernels=False`` (``INGOT_TRITON_KERNELS=0``)
keeps the references too, for debugging a suspected kernel: registration is
process-wide, so it applies from the first engine of the process.

Kernel modules, one per family: decode_attention, prefill_attention, kv_store,
rms_norm, rotary, activation, skinny_gemm (also rms_norm_linear, rms_norm_linear_scaled,
linear_norm_linear_scaled, silu_mul_linear). Each exposes a
function with its op's signature; the tuned ones also a ``launch_config(...)`` that picks the
launch parameters from shapes and device (a frozen config the function accepts as an optional
last argument, for sweeps and tests). rounding.py holds the bf16 rounding they share.
prefill_dispatch.py is the prefill op's CUDA implementation: it picks, from shapes, the fused
prefill kernel or PyTorch's flash / cuDNN attention paired with the context kernel.
"""

from __future__ import annotations

import logging
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
    from ingot.ops.triton import activation, decode_attention, kv_store, prefill_dispatch, rms_norm, rotary, skinny_gemm
    from ingot.ops.triton import fused_moe

    try:  # one tiny kernel: a broken toolchain (no C compiler for the launcher, ...) shows here
        x = torch.ones(2, 32, device="cuda")
        torch.cuda.synchronize()
        if not torch.allclose(activation.silu_and_mul(x).cpu(), torch.nn.functional.silu(torch.ones(2, 16))):
            raise RuntimeError("wrong result from the smoke-test kernel")
    except Exception as exc:  # keep serving on the references rather than failing later
        log.warning("Triton kernels unavailable, using the PyTorch reference ops: %s", exc)
        return False

    library.rms_norm.register_kernel("cuda")(rms_norm.rms_norm)
    library.add_rms_norm.register_kernel("cuda")(rms_norm.add_rms_norm)
    library.rotary_embedding.register_kernel("cuda")(rotary.rotary_embedding)
    library.silu_and_mul.register_kernel("cuda")(activation.silu_and_mul)
    library.store_kv.register_kernel("cuda")(kv_store.store_kv)
    library.decode_attention.register_kernel("cuda")(_decode_op(decode_attention.decode_attention))
    library.decode_attention_rope.register_kernel("cuda")(_decode_rope_op(decode_attention.decode_attention_rope))
    library.skinny_linear.register_kernel("cuda")(skinny_gemm.skinny_linear)
    library.rms_norm_linear.register_kernel("cuda")(skinny_gemm.rms_norm_linear)
    library.rms_norm_linear_scaled.register_kernel("cuda")(skinny_gemm.rms_norm_linear_scaled)
    library.linear_norm_linear_scaled.register_kernel("cuda")(skinny_gemm.linear_norm_linear_scaled)
    library.silu_mul_linear.register_kernel("cuda")(skinny_gemm.silu_mul_linear)
    library.prefill_attention.register_kernel("cuda")(_prefill_op(prefill_dispatch.prefill_attention))
    library.fused_moe.register_kernel("cuda")(fused_moe.fused_moe)
    _registered = True
    return True


def _decode_op(fn):
    # the op's exact signature (the kernel function takes extra keywords: num_splits, config)
    def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return fn(q, k_cache, v_cache, block_tables, seq_lens, scale)

    return decode_attention


def _decode_rope_op(fn):
    def decode_attention_rope(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
                              q_norm_weight=None, k_norm_weight=None, norm_eps=0.0):
        return fn(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
                  q_norm_weight, k_norm_weight, norm_eps)

    return decode_attention_rope


def _prefill_op(fn):
    def prefill_attention(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
        return fn(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)

    return prefill_attention


def is_registered() -> bool:
    return _registered
