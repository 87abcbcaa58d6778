"""Causal varlen prefill attention over packed tokens, with a paged context: two Triton kernels.

Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``n_b``
of them), the last ``n_b`` of its ``seq_lens[b]`` tokens. Its first ``p_b =
seq_lens[b] - n_b`` tokens (earlier chunks, chunked prefill, or a cached
prefix) are read from the paged cache through the block table; the new
tokens' keys and values are read directly from ``k``/``v`` (they are also in
the cache, but the packed tensors need no block-table gather).

``prefill_attention`` (the fused kernel) does all of it. Work is cut into
query tiles of ``BLOCK_M`` rows per sequence. A tiny kernel builds
``tile_starts`` (prefix sums of the tiles per sequence) on the device; the
main kernel gets an upper bound of the tile count from shapes (no host sync)
and finds its sequence by binary search; programs past the real count exit at
once. Grid ``(Hq, tiles)``: the query heads of one tile are neighbours in
launch order, so a GQA group's K/V tiles come from L2. Tiles run
heaviest-first (reverse order) to even out the causal triangle. Per program:
flash attention with online softmax in base 2, fp32 statistics and
accumulator, in three loops: the cached prefix (full ``BLOCK_N_CTX``-wide key
tiles without a mask, then one bounds-masked tail), the fully visible
new-token tiles before the query tile (no mask), and the diagonal tiles
(causal mask).

A sliding window starts the first two loops at its first visible tile (masked per row);
attention sinks (gpt-oss) join the denominator at the end (``softcap.softmax_denominator``).

``merge_cached_context`` (the context kernel) does only the cached prefix, for
a prefill whose new-token part someone else computed: it starts each query
row's online softmax from that part's normalized output and log-sum-exp
(natural log, as PyTorch's flash and cuDNN attention return it) and folds the
cached keys in, writing the output in place. Sequences without a cached prefix
exit at once. ``prefill_dispatch.py`` pairs it with PyTorch's attention.

Tile shapes come from fixed tables (``launch_config``, ``context_launch_config``),
so a call never autotunes or compiles a variant it did not already use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import capability, cdiv, interpreting, last_dim_contiguous, next_pow2, num_sms
from ingot.ops.triton.softcap import scaled_logits, softmax_denominator

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernels (the ``*launch_config`` tables pick them;
    sweeps and tests pass their own)."""

    block_m: int  # query rows per tile
    block_n: int  # key rows per tile over the new tokens; divides block_m
    num_warps: int
    num_stages: int
    block_n_ctx: Optional[int] = None  # key rows per tile over the cached prefix (None: block_n)
    ctx_stages: Optional[int] = None  # pipeline stages of the cached-prefix loop (None: num_stages)

    @property
    def ctx_tile(self) -> int:
        return self.block_n_ctx or self.block_n

    @property
    def ctx_pipeline(self) -> int:
        return self.ctx_stages or self.num_stages


@triton.jit(do_not_specialize=["num_seqs"])
def _tile_starts_kernel(cu_ptr, out_ptr, num_seqs, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[0] = 0, out[b + 1] = sum over sequences <= b of cdiv(n_b, BLOCK_M)."""
    carry = tl.full([], 0, tl.int32)
    tl.store(out_ptr, carry)
    for b0 in range(0, num_seqs, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        mask = offs < num_seqs
        start = tl.load(cu_ptr + offs, mask=mask, other=0).to(tl.int32)
        end = tl.load(cu_ptr + offs + 1, mask=mask, other=0).to(tl.int32)
        tiles = tl.where(mask, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
        tl.store(out_ptr + 1 + offs, tl.cumsum(tiles, 0) + carry, mask=mask)
        carry = carry + tl.sum(tiles, 0)


@triton.jit
def _attend_tile(q, k, v, m_i, l_i, acc, valid, scale_log2, cap_log2, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                 EMPTY_ROWS: tl.constexpr):
    """One K/V tile of flash attention (base-2 online softmax); ``valid`` [BM, BN] is used
    when MASKED. The scale is applied with the max subtraction (one fused multiply-add),
    or first, inside the soft-cap. EMPTY_ROWS: a row may have seen no visible key yet (a
    sliding window), its max still -inf, which must not turn into NaN."""
    s = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        s = scaled_logits(s, scale_log2, cap_log2, True)
        scale = 1.0
    else:
        scale = scale_log2
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if EMPTY_ROWS else m_new
    p = tl.exp2(s * scale - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _fold_cached_prefix(
    q, m_i, l_i, acc, kc_head, vc_head, bt_row, prefix, stride_cb, stride_cs, scale_log2, cap_log2, q_pos, window,
    offs_d, d_mask,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, EVEN_D: tl.constexpr, DOT_F32: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Attend to a sequence's first ``prefix`` tokens, read from the paged cache: every
    query row sees all of them, so full tiles need no mask; one masked tail tile. The K
    and V caches share their strides (one row offset serves both). The block-id load that
    each tile's addresses wait for takes one of the loop's ``STAGES`` pipeline stages.
    With a sliding WINDOW the tiles start at the first key the first query (least ``q_pos``)
    sees, every one masked (its rows see different keys)."""
    offs_n = tl.arange(0, BLOCK_N)
    lo = 0
    n_full = (prefix // BLOCK_N) * BLOCK_N
    if WINDOW:
        lo = tl.maximum(tl.min(q_pos, 0) - window + 1, 0)
        n_full = 0
    for n0 in tl.range(0, n_full, BLOCK_N, num_stages=STAGES):
        pos = n0 + offs_n
        blk = tl.load(bt_row + pos // PAGE).to(tl.int64)
        rows = blk * stride_cb + (pos % PAGE) * stride_cs
        if EVEN_D:
            k = tl.load(kc_head + rows[:, None] + offs_d[None, :])
            v = tl.load(vc_head + rows[:, None] + offs_d[None, :])
        else:
            k = tl.load(kc_head + rows[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
            v = tl.load(vc_head + rows[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, None, scale_log2, cap_log2, False, SOFTCAP, False)
    # the tail tile, or every windowed tile
    for n0 in range(tl.maximum(n_full, (lo // BLOCK_N) * BLOCK_N), prefix, BLOCK_N):
        pos = n0 + offs_n
        n_mask = (pos < prefix) & (pos >= lo)
        blk = tl.load(bt_row + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = blk * stride_cb + (pos % PAGE) * stride_cs
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_head + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vc_head + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        valid = n_mask[None, :]
        if WINDOW:
            valid = valid & (q_pos[:, None] - pos[None, :] < window)
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, valid, scale_log2, cap_log2, True, SOFTCAP, WINDOW)
    return m_i, l_i, acc


@triton.jit
def _load_rows(ptrs, row_mask, d_mask, EVEN_D: tl.constexpr):
    """A [rows, BLOCK_D] tile; ``row_mask`` None when every row is in range."""
    if row_mask is None:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    else:
        x = tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    return x


# runtime sizes that vary per step: not specialized (no recompiles mid-serving)
@triton.jit(do_not_specialize=["num_seqs", "search_steps", "num_tiles_ub", "stride_bt", "window"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
    cu_q_ptr, seq_lens_ptr, block_tables_ptr, tile_starts_ptr, out_ptr, sinks_ptr,
    scale_log2, cap_log2, window,
    num_seqs, search_steps, num_tiles_ub,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_CTX: tl.constexpr,
    CTX_STAGES: tl.constexpr, DOT_F32: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    h = tl.program_id(0)
    t = num_tiles_ub - 1 - tl.program_id(1)  # heaviest tiles first
    total = tl.load(tile_starts_ptr + num_seqs)
    if t < total:
        # sequence of tile t: the largest b with tile_starts[b] <= t
        lo = tl.full([], 0, tl.int32)
        hi = tl.full([], 0, tl.int32) + num_seqs - 1
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            ok = tl.load(tile_starts_ptr + mid) <= t
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        b = lo
        m0 = (t - tl.load(tile_starts_ptr + b)) * BLOCK_M
        q_start = tl.load(cu_q_ptr + b).to(tl.int32)
        q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_start
        prefix = tl.load(seq_lens_ptr + b).to(tl.int32) - q_len
        kvh = h // GROUP

        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        q_rows = (q_start + offs_m).to(tl.int64)
        q = _load_rows(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], m_mask, d_mask, EVEN_D)
        if DOT_F32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # 1) the cached prefix (earlier chunks): every query sees all of it (within its window)
        q_pos = prefix + offs_m  # the queries' positions in the sequence
        m_i, l_i, acc = _fold_cached_prefix(
            q, m_i, l_i, acc, k_cache_ptr + kvh * stride_ch, v_cache_ptr + kvh * stride_ch,
            block_tables_ptr + b.to(tl.int64) * stride_bt, prefix, stride_cb, stride_cs, scale_log2, cap_log2,
            q_pos, window, offs_d, d_mask, PAGE, BLOCK_N_CTX, CTX_STAGES, EVEN_D, DOT_F32, WINDOW, SOFTCAP,
        )

        # 2) new tokens before this query tile: fully visible (BLOCK_M % BLOCK_N == 0); with a
        # window, from the tile of the first key the tile's first query sees, masked
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        n_lo = (tl.maximum(m0 - window + 1, 0) // BLOCK_N) * BLOCK_N if WINDOW else 0
        for n0 in range(n_lo, m0, BLOCK_N):
            rows = (q_start + n0 + offs_n).to(tl.int64)
            k = _load_rows(k_head + rows[:, None] * stride_kt + offs_d[None, :], None, d_mask, EVEN_D)
            v = _load_rows(v_head + rows[:, None] * stride_vt + offs_d[None, :], None, d_mask, EVEN_D)
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            valid = offs_m[:, None] - (n0 + offs_n)[None, :] < window
            m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, valid, scale_log2, cap_log2, WINDOW, SOFTCAP, WINDOW)

        # 3) the diagonal: causal mask
        n_end = tl.minimum(m0 + BLOCK_M, q_len)
        for n0 in range(m0, n_end, BLOCK_N):
            pos = n0 + offs_n
            n_mask = pos < q_len
            rows = (q_start + pos).to(tl.int64)
            k = _load_rows(k_head + rows[:, None] * stride_kt + offs_d[None, :], n_mask, d_mask, EVEN_D)
            v = _load_rows(v_head + rows[:, None] * stride_vt + offs_d[None, :], n_mask, d_mask, EVEN_D)
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            valid = (pos[None, :] <= offs_m[:, None]) & n_mask[None, :]
            if WINDOW:
                valid = valid & (offs_m[:, None] - pos[None, :] < window)
            m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, valid, scale_log2, cap_log2, True, SOFTCAP, WINDOW)

        o = acc / softmax_denominator(l_i, m_i, sinks_ptr, h, None, HAS_SINKS)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _context_tile(
    m0, b, h, q_start, q_len, prefix, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, out_ptr, lse_ptr, scale_log2,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh, stride_lb, stride_lh, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CTX_STAGES: tl.constexpr, LSE_GLOBAL_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Query tile ``m0`` of sequence ``b``, head ``h``: fold the cached prefix into ``out``."""
    kvh = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = _load_rows(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], m_mask, d_mask, EVEN_D)
    if DOT_F32:
        q = q.to(tl.float32)
    # the new-token part as an online-softmax state: max = its log-sum-exp, sum = 1
    out_rows = out_ptr + q_rows * stride_ot + h * stride_oh
    acc = _load_rows(out_rows[:, None] + offs_d[None, :], m_mask, d_mask, EVEN_D).to(tl.float32)
    if LSE_GLOBAL_ROWS:
        lse_rows = q_start + offs_m
    else:
        lse_rows = offs_m
    lse = tl.load(lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + lse_rows.to(tl.int64) * stride_lt,
                  mask=m_mask, other=0.0)
    m_i = lse * 1.4426950408889634
    l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    m_i, l_i, acc = _fold_cached_prefix(  # (no window, no soft-cap: the dispatch sends those to the fused kernel)
        q, m_i, l_i, acc, k_cache_ptr + kvh * stride_ch, v_cache_ptr + kvh * stride_ch,
        block_tables_ptr + b.to(tl.int64) * stride_bt, prefix, stride_cb, stride_cs, scale_log2, 0.0,
        offs_m, 0, offs_d, d_mask, PAGE, BLOCK_N, CTX_STAGES, EVEN_D, DOT_F32, False, False,
    )
    o = acc / l_i[:, None]
    tl.store(out_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["tile_groups", "stride_bt", "stride_lb", "stride_lh", "stride_lt"])
def _context_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_q_ptr, seq_lens_ptr, block_tables_ptr, out_ptr, lse_ptr,
    scale_log2, tile_groups,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    stride_lb, stride_lh, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CTX_STAGES: tl.constexpr, LSE_GLOBAL_ROWS: tl.constexpr,
    LOOP: tl.constexpr, DOT_F32: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    h = tl.program_id(0)
    b = tl.program_id(1) // tile_groups  # the programs of one sequence (one prefix) are neighbours
    group = tl.program_id(1) % tile_groups  # takes query tiles group, group + tile_groups, ...
    q_start = tl.load(cu_q_ptr + b).to(tl.int32)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_start
    prefix = tl.load(seq_lens_ptr + b).to(tl.int32) - q_len
    if prefix > 0:
        if LOOP:  # (a loop around the tile costs registers: only when programs take several tiles)
            for m0 in range(group * BLOCK_M, q_len, tile_groups * BLOCK_M):
                _context_tile(
                    m0, b, h, q_start, q_len, prefix, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, out_ptr,
                    lse_ptr, scale_log2, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot,
                    stride_oh, stride_lb, stride_lh, stride_lt, GROUP, HEAD_DIM, BLOCK_D, PAGE, BLOCK_M, BLOCK_N,
                    CTX_STAGES, LSE_GLOBAL_ROWS, EVEN_D, DOT_F32,
                )
        elif group * BLOCK_M < q_len:
            _context_tile(
                group * BLOCK_M, b, h, q_start, q_len, prefix, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                out_ptr, lse_ptr, scale_log2, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
                stride_ot, stride_oh, stride_lb, stride_lh, stride_lt, GROUP, HEAD_DIM, BLOCK_D, PAGE, BLOCK_M,
                BLOCK_N, CTX_STAGES, LSE_GLOBAL_ROWS, EVEN_D, DOT_F32,
            )


def launch_config(head_dim: int, device: torch.device) -> PrefillConfig:
    """Tile shape of the fused kernel by head dim. Head dim 128 on sm_90 (Hopper): 128 x 128
    tiles, 8 warps, 3 stages (5 over the cached prefix), Triton's autotuner's pick from five
    candidates (for a 4096-token causal prefill, 28/4 heads, under 1% ahead of 64-wide key
    tiles; re-measure with ``python -m benchmarks.kernels --sweep prefill``). Elsewhere 64-wide
    key tiles, and smaller tiles above head dim 128 for shared memory."""
    block_d = next_pow2(head_dim)
    if block_d <= 64:
        return PrefillConfig(128, 64, 4, 3)
    if block_d <= 128:
        if capability(device) == (9, 0):
            # a 5-stage cached-prefix loop: about 5% faster than 3 stages at 8 x (512 new | 2048 cached)
            return PrefillConfig(128, 128, 8, 3, ctx_stages=5)
        return PrefillConfig(128, 64, 8, 3)
    return PrefillConfig(64, 32, 4, 2)


def context_launch_config(head_dim: int, device: torch.device) -> PrefillConfig:
    """The context kernel's tiles: the fused kernel's table (same prefix loop); ``ctx_tile`` the key tile."""
    return launch_config(head_dim, device)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride(), "KV caches: contiguous rows, one layout"


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
    config: Optional[PrefillConfig] = None,
) -> torch.Tensor:
    """The fused Triton kernel for ``torch.ops.ingot.prefill_attention`` (see reference.py)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    _check_caches(k_cache, v_cache)
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if out.stride(-1) != 1:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_d = max(16, next_pow2(head_dim))
    cfg = config or launch_config(head_dim, q.device)
    block_m = cfg.block_m
    assert block_m % cfg.block_n == 0, "block_n must divide block_m"

    tile_starts = torch.empty(num_seqs + 1, dtype=torch.int32, device=q.device)
    _tile_starts_kernel[(1,)](
        cu_seqlens_q, tile_starts, num_seqs,
        BLOCK_M=block_m, BLOCK_B=256, num_warps=4,
    )
    # sum_b cdiv(n_b, BM) <= (T + B * (BM - 1)) // BM: an upper bound from shapes alone
    num_tiles_ub = (num_tokens + num_seqs * (block_m - 1)) // block_m
    search_steps = max(1, (num_seqs - 1).bit_length() + 1)
    grid = (num_q_heads, num_tiles_ub)
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache,
        cu_seqlens_q, seq_lens, block_tables, tile_starts, out, q if sinks is None else sinks.contiguous(),
        float(scale) * _LOG2E, float(softcap) * _LOG2E, max(int(window), 0),
        num_seqs, search_steps, num_tiles_ub,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_N_CTX=cfg.ctx_tile,
        CTX_STAGES=cfg.ctx_pipeline, DOT_F32=interpreting(), WINDOW=window > 0, SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def context_tile_groups(max_new_tokens: int, num_seqs: int, num_q_heads: int, block_m: int, waves: Optional[int],
                        device: torch.device) -> int:
    """Programs per (sequence, query head) of the context kernel, each taking every
    ``groups``-th query tile of its sequence: one per tile (``waves`` None), or enough for
    ``waves`` programs per SM (one program fills an SM's shared memory at 128-row tiles).
    A program whose sequence has no cached prefix exits at once, but a wave of them still
    costs microseconds, so few programs where little cached context is expected."""
    tiles = cdiv(max(1, max_new_tokens), block_m)
    if waves is None:
        return tiles
    return max(1, min(tiles, cdiv(waves * num_sms(device), num_q_heads * num_seqs)))


def merge_cached_context(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lse_strides: tuple[int, int, int],
    lse_global_rows: bool,
    max_new_tokens: int,
    scale: float,
    config: Optional[PrefillConfig] = None,
    waves: Optional[int] = None,
) -> torch.Tensor:
    """Fold each sequence's cached prefix into ``out`` [T, Hq, D] (in place, returned).

    ``out`` holds the causal attention of the new tokens among themselves (normalized)
    and ``lse`` its natural-log log-sum-exp: the element of sequence ``b``, query head
    ``h`` and query row ``r`` sits at ``b * lse_strides[0] + h * lse_strides[1] + row *
    lse_strides[2]``, where ``row`` is the packed row ``cu_seqlens_q[b] + r`` when
    ``lse_global_rows``, else ``r``. ``max_new_tokens`` bounds every sequence's new
    tokens (from shapes: no host sync); ``waves``: see ``context_tile_groups``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert out.stride(-1) == 1 and out.shape == q.shape
    _check_caches(k_cache, v_cache)
    q = last_dim_contiguous(q)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    cfg = config or context_launch_config(head_dim, q.device)
    tiles = cdiv(max(1, min(max_new_tokens, num_tokens)), cfg.block_m)
    groups = context_tile_groups(min(max_new_tokens, num_tokens), num_seqs, num_q_heads, cfg.block_m, waves, q.device)
    grid = (num_q_heads, num_seqs * groups)
    _context_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse,
        float(scale) * _LOG2E, groups,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *lse_strides,
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        PAGE=k_cache.shape[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.ctx_tile, CTX_STAGES=cfg.ctx_pipeline,
        LSE_GLOBAL_ROWS=lse_global_rows, LOOP=groups < tiles, DOT_F32=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


__all__ = [
    "prefill_attention", "merge_cached_context", "context_tile_groups", "launch_config", "context_launch_config", "PrefillConfig",
]
