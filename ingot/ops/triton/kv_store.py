"""store_kv: scatter this step's k, v [T, Hkv, D] into the paged caches by slot.

One program per (token, head chunk); the caches are written in place (the
custom op declares them in ``mutates_args``). Slot ``s`` is row ``s % block_size``
of block ``s // block_size``; negative slots are skipped. Padding tokens map to
slot 0 (the dummy block), so they may race with each other there, harmlessly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cuda_kernel, last_dim_contiguous, next_pow2


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // PAGE
        off = slot % PAGE
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs
        vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs
        tl.store(
            kc + offs_h[:, None] * stride_kch + offs_d[None, :],
            k.to(k_cache_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(
            vc + offs_h[:, None] * stride_vch + offs_d[None, :],
            v.to(v_cache_ptr.dtype.element_ty),
            mask=mask,
        )


@cuda_kernel
def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton implementation of ``torch.ops.ingot.store_kv`` (see reference.py)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache rows must be contiguous"
    k = last_dim_contiguous(k)
    v = last_dim_contiguous(v)
    page = k_cache.shape[1]
    block_d = next_pow2(head_dim)
    # about 2K elements per program: whole rows for small models, head chunks for big ones
    block_h = max(1, min(next_pow2(num_heads), 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )
