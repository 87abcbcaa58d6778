"""The CUDA implementation of ``torch.ops.ingot.prefill_attention``: which path runs a prefill.

Every path computes the op exactly (the reference's meaning, for any batch: sequences
with and without a cached prefix mixed); they differ only in speed, so the choice is
made from shapes alone, in ``choose_prefill_path``, without reading the lengths back
from the GPU (no host sync: the engine launches steps ahead of the GPU).

- ``"triton"``: the fused Triton kernel (``prefill_attention.py``): cached prefix,
  new tokens and the causal diagonal in one launch.
- ``"flash"``: PyTorch's flash attention (``aten._flash_attention_forward``, varlen,
  GQA native) over the new tokens among themselves (causal), then the Triton context
  kernel folds each sequence's cached prefix into that output through the log-sum-exp
  flash returns (sequences without a prefix: nothing to fold, those programs exit).
- ``"cudnn"``: one dense block of new tokens (``dense_block``): PyTorch's cuDNN attention
  (``aten._scaled_dot_product_cudnn_attention``, dense ``[B, H, L, D]``, what
  ``scaled_dot_product_attention`` runs on Hopper GPUs when it prefers cuDNN) over
  the new tokens, then the context kernel. cuDNN builds one execution plan per shape
  (cached by PyTorch; tens of milliseconds each), so one sequence's tokens are padded at the end
  to a multiple of ``CUDNN_LENGTH_MULTIPLE``: a causal query never sees a later key, so
  the real rows are exact, and a server pays for at most ``max_model_len / 256`` plans
  instead of one per prompt length. Several sequences take this path only when they are
  prompts of one length that is already such a multiple (each fills its block-table row:
  nothing cached): ``[B, L]`` views, one plan per batch size and length.
- ``"gather"``: the sequences' KV blocks are gathered into one contiguous buffer
  (``B x capacity`` rows, a block-granular copy) and one flash varlen call attends
  over the whole context with the bottom-right causal mask (``seqused_k`` = the
  sequence lengths).

Lengths are bounded from shapes: no sequence has more new tokens than the step
(``T``) or than its block-table row holds (``capacity`` = table width x page). When
``B x capacity == T`` every sequence's new tokens fill its row (``fills_rows``), so nothing
is cached: the flash and cuDNN paths then skip the context kernel (and cuDNN its
log-sum-exp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ingot.ops.triton._common import capability, cuda_kernel

if TYPE_CHECKING:  # the Triton kernels are imported when a path needs them (CPU installs have no Triton)
    from ingot.ops.triton.prefill_attention import PrefillConfig

PATHS = ("triton", "flash", "cudnn", "gather")
CUDNN_LENGTH_MULTIPLE = 256  # cuDNN's plans are per length: pad to this, bounding them to max_model_len / 256
GATHER_MAX_BYTES = 256 << 20  # the gathered K and V together; beyond it the copy costs memory the pool sizing never saw


@dataclass(frozen=True)
class PathRule:
    """The path for one class of prefill, used while the mean new tokens per sequence is in
    ``[min_tokens_per_seq, max_tokens_per_seq)``; outside it the fused kernel runs."""

    path: str = "triton"
    min_tokens_per_seq: int = 0
    max_tokens_per_seq: Optional[int] = None


# The launch rule, by (one dense block?, mostly new tokens?), where "one dense block" means one
# sequence, or prompts of one length that is a multiple of 256 (``dense_block``), and "mostly
# new" that the new tokens fill at least half of the batch's block-table capacity (2 T >= B x
# capacity: no or a short cached prefix). Re-measured by `python -m benchmarks.kernels --sweep prefill`
# (34 shapes, 28/4 and 12/2 heads):
# - several mostly-new prompts averaging under 256 tokens: PyTorch's varlen flash (32 x 128
#   tokens 0.61x the fused kernel's time, 128 x 30 tokens 0.38x); from 500 tokens on the
#   fused kernel wins (8 x 500: 0.89x flash's time; 4 x 1000: 0.77x);
# - one prompt of 256 tokens or more: cuDNN (0.69x the fused kernel's time at 256 tokens, 0.87x
#   at 1000, 0.75x at 4096); its first call at a new length costs far more than the attention
#   (it builds a plan), so lengths are padded to a multiple of 256 (``cudnn_dense``): one plan
#   per 256 tokens;
# - 8 prompts of 512 tokens: cuDNN's dense batch in under half the fused kernel's time, hence
#   the dense blocks of equal prompts;
# - cached context: the fused kernel, everywhere.
PREFILL_RULES: dict[tuple[bool, bool], PathRule] = {
    (True, True): PathRule("cudnn", min_tokens_per_seq=256),
    (True, False): PathRule("triton"),
    (False, True): PathRule("flash", max_tokens_per_seq=256),
    (False, False): PathRule("triton"),
}


def fills_rows(num_tokens: int, num_seqs: int, context_capacity: int) -> bool:
    """Every sequence's new tokens fill its whole block-table row: prompts of one length
    (``context_capacity``) with nothing cached."""
    return num_seqs * context_capacity == num_tokens


def dense_block(num_tokens: int, num_seqs: int, context_capacity: int) -> bool:
    """The new tokens are one dense ``[B, L]`` block that cuDNN's dense attention takes:
    one sequence (padded to ``CUDNN_LENGTH_MULTIPLE``), or prompts of one length that is
    already a multiple of it (as views, no copy)."""
    return num_seqs == 1 or (
        fills_rows(num_tokens, num_seqs, context_capacity) and context_capacity % CUDNN_LENGTH_MULTIPLE == 0
    )


def prefill_class(num_tokens: int, num_seqs: int, context_capacity: int) -> tuple[bool, bool]:
    """(one dense block, mostly new tokens): the key of ``PREFILL_RULES``."""
    return dense_block(num_tokens, num_seqs, context_capacity), 2 * num_tokens >= num_seqs * context_capacity


@functools.lru_cache(maxsize=None)
def _aten_args(op_name: str) -> frozenset:
    op = getattr(torch.ops.aten, op_name, None)
    if op is None:
        return frozenset()
    return frozenset(a.name for a in op.default._schema.arguments)


def flash_available() -> bool:
    """PyTorch was built with flash attention and exposes its varlen forward."""
    backends = getattr(torch.backends, "cuda", None)
    built = getattr(backends, "is_flash_attention_available", lambda: True)()
    return built and "cum_seq_q" in _aten_args("_flash_attention_forward")


CUDNN_MIN_VERSION = 91501  # PyTorch prefers cuDNN's attention from 9.15.1 (fixed lengths not a multiple of 128)


def cudnn_available() -> bool:
    """PyTorch's dense cuDNN attention op, on a cuDNN recent enough that PyTorch's own SDPA
    prefers it (``check_prefer_cudnn_attention`` in PyTorch's sdp_utils.cpp)."""
    if not torch.backends.cudnn.is_available() or "attn_bias" not in _aten_args("_scaled_dot_product_cudnn_attention"):
        return False
    version = torch.backends.cudnn.version()
    return version is not None and version >= CUDNN_MIN_VERSION


def path_supported(
    path: str, num_tokens: int, num_seqs: int, context_capacity: int,
    num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
) -> bool:
    """Whether ``path`` can run this prefill (the fused kernel always can)."""
    if path == "triton":
        return True
    if path not in PATHS:
        raise ValueError(f"unknown prefill path {path!r}; expected one of {PATHS}")
    if device.type != "cuda" or capability(device) < (8, 0):
        return False
    if dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or num_q_heads % num_kv_heads:
        return False
    if path == "cudnn":
        return dense_block(num_tokens, num_seqs, context_capacity) and num_tokens >= 2 and head_dim <= 128 and cudnn_available()
    if head_dim > 256 or not flash_available():
        return False
    if path == "gather":
        gathered = 2 * num_seqs * context_capacity * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
        return gathered <= GATHER_MAX_BYTES and "seqused_k" in _aten_args("_flash_attention_forward")
    return True


def choose_prefill_path(
    num_tokens: int, num_seqs: int, context_capacity: int,
    num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    rules: Optional[dict] = None, window: int = 0, softcap: float = 0.0, sinks: bool = False,
) -> str:
    """The one launch decision: a path from ``PREFILL_RULES`` by the prefill's class and mean
    new tokens per sequence, or the fused kernel where that path cannot run. A sliding
    ``window``, a ``softcap`` or attention ``sinks`` take the fused kernel, the one path that applies them."""
    if window > 0 or softcap > 0 or sinks:
        return "triton"
    rule = (rules or PREFILL_RULES)[prefill_class(num_tokens, num_seqs, context_capacity)]
    if num_tokens < rule.min_tokens_per_seq * num_seqs:
        return "triton"
    if rule.max_tokens_per_seq is not None and num_tokens >= rule.max_tokens_per_seq * num_seqs:
        return "triton"
    args = (num_tokens, num_seqs, context_capacity, num_q_heads, num_kv_heads, head_dim, dtype, device)
    return rule.path if path_supported(rule.path, *args) else "triton"


# ----------------------------------------------------------------------------- PyTorch attention
def flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, scale: float, seqused_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, Hq, D], log-sum-exp): PyTorch's flash varlen forward, causal (bottom-right:
    query ``i`` of a sequence with ``n`` queries and ``s`` keys sees keys ``<= s - n + i``).
    The log-sum-exp is ``[Hq, T]`` (PyTorch 2.5+) or ``[B, Hq, max_q]`` (older flash)."""
    extra = {} if seqused_k is None else {"seqused_k": seqused_k}
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale, **extra)
    return res[0], res[1]


def cudnn_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, S, D], log-sum-exp [B, Hq, S(, 1)], if asked for): PyTorch's cuDNN
    attention on dense ``[B, H, S, D]`` tensors, causal (top-left: query ``i`` sees keys
    ``<= i``). Without the log-sum-exp cuDNN runs its inference kernel, as SDPA does."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, True, False, scale=scale)
    return res[0], res[1]


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` ([T, H, D]) as a contiguous ``[rows, H, D]`` tensor whose rows past T are zero
    (no copy when it already is one)."""
    if t.shape[0] == rows and t.is_contiguous():
        return t
    out = t.new_empty((rows, *t.shape[1:]))
    out[: t.shape[0]].copy_(t)
    out[t.shape[0] :].zero_()
    return out


def cudnn_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lse: bool = True, num_seqs: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, Hq, D], log-sum-exp [B, Hq, L(, 1)] as a view of rows of the padded one):
    ``cudnn_sdpa`` over ``num_seqs`` packed sequences of ``L = T / B`` tokens each, as
    ``[B, H, S, D]`` views of contiguous ``[B * S, H, D]`` tensors (the layout PyTorch's SDPA
    hands cuDNN). One sequence is padded with zero rows at the end to ``S``, its length
    rounded up to ``CUDNN_LENGTH_MULTIPLE`` (causal: no real query sees them); several must
    already have such a length (``dense_block``). q/k/v are copied when padded or not
    contiguous."""
    num_tokens = q.shape[0]
    length = num_tokens // num_seqs
    rows = -(-length // CUDNN_LENGTH_MULTIPLE) * CUDNN_LENGTH_MULTIPLE
    if num_seqs > 1 and (rows != length or length * num_seqs != num_tokens):
        raise ValueError(f"cuDNN's dense batch takes sequences of one length, a multiple of {CUDNN_LENGTH_MULTIPLE}; "
                         f"got {num_tokens} tokens in {num_seqs} sequences")
    qd, kd, vd = (_padded_rows(t, num_seqs * rows).view(num_seqs, rows, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    out, stats = cudnn_sdpa(qd, kd, vd, scale, lse)
    if lse:
        stats = stats[:, :, :length]
    return out.transpose(1, 2)[:, :length].reshape(num_tokens, *q.shape[1:]), stats


def lse_layout(lse: torch.Tensor) -> tuple[tuple[int, int, int], bool]:
    """(strides by sequence, head and row; rows are packed rows) of a returned log-sum-exp:
    ``[Hq, T]`` (flash varlen): packed rows; ``[B, Hq, S(, 1)]`` (older flash varlen, cuDNN
    dense): rows within the sequence."""
    if lse.dim() == 2:
        return (0, lse.stride(0), lse.stride(1)), True
    return (lse.stride(0), lse.stride(1), lse.stride(2)), False


# ----------------------------------------------------------------------------- gather
def gather_paged_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v [B * capacity, Hkv, D], cu_k [B + 1]): every block of every block-table row,
    copied in table order, so sequence ``b``'s token ``p`` sits at row ``b * capacity + p``
    (``capacity`` = table width x page); rows past a sequence's length hold whatever its
    table's unused entries (block 0) hold and are never read (``seqused_k``)."""
    num_seqs, width = block_tables.shape
    page, num_kv_heads, head_dim = k_cache.shape[1:]
    capacity = width * page
    ids = block_tables.reshape(-1)
    k = k_cache.index_select(0, ids).view(num_seqs * capacity, num_kv_heads, head_dim)
    v = v_cache.index_select(0, ids).view(num_seqs * capacity, num_kv_heads, head_dim)
    cu_k = torch.arange(0, (num_seqs + 1) * capacity, capacity, dtype=torch.int32, device=block_tables.device)
    return k, v, cu_k


# ----------------------------------------------------------------------------- the op
@cuda_kernel
def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    path: Optional[str] = None,
    config: Optional["PrefillConfig"] = None,
) -> torch.Tensor:
    """CUDA implementation of ``torch.ops.ingot.prefill_attention`` (see reference.py):
    ``path`` (default: ``choose_prefill_path``) and ``config`` (the Triton kernels'
    ``PrefillConfig``) are for benchmarks and tests."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return torch.empty_like(q)
    capacity = block_tables.shape[1] * k_cache.shape[1]
    if path is None:
        path = choose_prefill_path(num_tokens, num_seqs, capacity, num_q_heads, k.shape[1], head_dim, q.dtype, q.device,
                                   window=window, softcap=softcap, sinks=sinks is not None)
    elif path != "triton" and (window > 0 or softcap > 0 or sinks is not None):
        raise ValueError(f"prefill path {path!r} applies no sliding window, soft-cap or sinks; only 'triton' does")
    cu_q, seq_lens = cu_seqlens_q.to(torch.int32), seq_lens.to(torch.int32)
    # the longest new-token run of any sequence is at most T and at most its table row;
    # at least 2 keeps flash off its one-query path (it would drop the causal flag)
    max_q = max(2, min(num_tokens, capacity))
    if path == "triton":
        from ingot.ops.triton import prefill_attention as kernels

        return kernels.prefill_attention(q, k, v, k_cache, v_cache, cu_q, seq_lens, block_tables, scale, window, softcap,
                                         sinks, config)
    if path == "gather":
        k_all, v_all, cu_k = gather_paged_kv(k_cache, v_cache, block_tables)
        return flash_varlen(q, k_all, v_all, cu_q, cu_k, max_q, capacity, scale, seqused_k=seq_lens)[0]
    # each sequence's new tokens fill its whole table row: nothing is cached, no context to fold
    no_context = fills_rows(num_tokens, num_seqs, capacity)
    if path == "flash":
        out, lse = flash_varlen(q, k, v, cu_q, cu_q, max_q, max_q, scale)
    elif path == "cudnn":
        out, lse = cudnn_dense(q, k, v, scale, lse=not no_context, num_seqs=num_seqs)
    else:
        raise ValueError(f"unknown prefill path {path!r}; expected one of {PATHS}")
    if no_context:
        return out
    from ingot.ops.triton import prefill_attention as kernels

    strides, global_rows = lse_layout(lse)
    # mostly new tokens: little cached context expected, so one wave of context programs (each
    # that finds no prefix still occupies an SM for a moment); else one program per query tile
    waves = 1 if prefill_class(num_tokens, num_seqs, capacity)[1] else None
    return kernels.merge_cached_context(
        q, k_cache, v_cache, cu_q, seq_lens, block_tables, out, lse, strides, global_rows, max_q, scale, config, waves,
    )


__all__ = [
    "PATHS", "PathRule", "PREFILL_RULES", "fills_rows", "dense_block", "prefill_class", "choose_prefill_path", "path_supported",
    "gather_paged_kv", "flash_varlen", "cudnn_sdpa", "cudnn_dense", "CUDNN_LENGTH_MULTIPLE", "lse_layout", "prefill_attention",
]
