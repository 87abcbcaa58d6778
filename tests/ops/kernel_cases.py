"""Inputs and error measures shared by the kernel tests (GPU and interpreter); imports no Triton."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """||out - expected|| / ||expected||; NaN (an unwritten, poisoned element) never passes."""
    out, expected = out.float(), expected.float()
    assert out.shape == expected.shape
    assert not torch.isnan(out).any(), "NaN in the output (unwritten element?)"
    return ((out - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def paged(lens, page, hkv, d, dtype, gen, extra_cols=2, device="cpu"):
    """Random caches and a shuffled block table covering ``lens`` (unused columns 0)."""
    b = len(lens)
    m = max(-(-n // page) for n in lens) + extra_cols
    nb = b * m + 2
    k_cache = torch.randn(nb, page, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, page, hkv, d, generator=gen).to(dtype)
    ids = (torch.randperm(nb - 1, generator=gen) + 1)[: b * m].view(b, m)
    table = torch.zeros(b, m, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // page)
        table[i, :used] = ids[i, :used].to(torch.int32)
    return k_cache.to(device), v_cache.to(device), table.to(device)


def rope_table(max_pos: int, d: int, base: float = 1e6) -> torch.Tensor:
    """fp32 ``[max_pos, d]`` cos|sin table, built as the model builds it."""
    inv = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def rope_decode_case(lens, hq, hkv, d, page, dtype, gen, device="cpu", pad_row=True, qk_norm=False):
    """Arguments of ``decode_attention_rope`` for one decode step of sequences of ``lens``
    (this step's token included): q/k/v are strided views of one qkv tensor, as in the
    model; each new token's cache slot starts as NaN, so reading it from the cache
    instead of registers fails. With ``pad_row`` the last row is a graph padding row
    (length 1, empty block table, slot 0 in the dummy block). With ``qk_norm`` the per-head
    q and k RMSNorm weights (around 1) and eps follow."""
    k_cache, v_cache, table = paged(lens, page, hkv, d, dtype, gen)
    b = len(lens)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, : hq * d].view(b, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(b, hkv, d)
    positions = torch.tensor(lens, dtype=torch.int64) - 1
    slots = torch.stack([table[i, int(p) // page].long() * page + int(p) % page for i, p in enumerate(positions)])
    if pad_row:
        table[-1] = 0
        slots[-1] = 0
    for s in slots.tolist():
        k_cache[s // page, s % page] = float("nan")
        v_cache[s // page, s % page] = float("nan")
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = [q, k, v, positions, rope_table(max(lens) + 1, d), k_cache, v_cache, slots, table, seq_lens, d**-0.5]
    if qk_norm:
        args += [(1 + 0.3 * torch.randn(d, generator=gen)).to(dtype), (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype), 1e-6]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def check_rope_decode(fn, args, tol: float = 1e-2) -> None:
    """Run ``fn`` (a kernel) on ``args`` and the reference on copies; compare outputs and caches."""
    from ingot.ops import reference as ref

    exp_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*args)
    expected = ref.decode_attention_rope(*exp_args)
    assert out.dtype == args[0].dtype
    assert rel_err(out, expected) < tol
    normed = len(args) > 11  # the q/k norm's fp32 sum runs in another order: the new k within rounding
    for got, want in ((args[5], exp_args[5]), (args[6], exp_args[6])):  # k_cache, v_cache
        # block 0 is the padding dummy; every other row (the rotated new k included) bit-exact
        if normed:
            assert rel_err(got[1:].nan_to_num(7.0), want[1:].nan_to_num(7.0)) < 1e-2
        else:
            assert torch.equal(got[1:].nan_to_num(7.0), want[1:].nan_to_num(7.0))


def check_store_kv(fn, t, hkv, d, page, nb, gen, device="cpu", dtype=torch.bfloat16) -> None:
    """Run a store_kv kernel ``fn`` and the reference on NaN-filled caches; k/v are strided
    views of one qkv tensor, as in the model, and the last rows are padding (slot 0)."""
    from ingot.ops import reference as ref

    qkv = torch.randn(t, (4 + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    k = qkv[:, 4 * d : (4 + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (4 + hkv) * d :].reshape(t, hkv, d)
    n_pad = min(2, t - 1)
    slots = (torch.randperm((nb - 1) * page, generator=gen)[: t - n_pad] + page).tolist() + [0] * n_pad
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    k_cache = torch.full((nb, page, hkv, d), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    fn(k, v, k_cache, v_cache, slot_mapping)
    ref.store_kv(k, v, k_exp, v_exp, slot_mapping)
    # block 0 is the padding dummy (written racily by design); the rest must match bit for bit
    assert torch.equal(k_cache[1:].nan_to_num(7.0), k_exp[1:].nan_to_num(7.0))
    assert torch.equal(v_cache[1:].nan_to_num(7.0), v_exp[1:].nan_to_num(7.0))


def check_prologue_linear(mod, prologue: str, m: int, n: int, k: int, bias: bool, gen, device="cpu", config=None) -> None:
    """``rms_norm_linear`` / ``rms_norm_linear_scaled`` (prologue "norm" / "norm_scaled"),
    ``silu_mul_linear`` ("silu") or ``gelu_tanh_mul_linear`` ("gelu") of module ``mod`` (skinny_gemm) against the reference ops: a random
    projection within bf16 tolerance, and an identity projection, whose output is the
    prologue's bf16 result itself, element for element; "norm_scaled"'s two factors of the
    normed rows against the reference's. ``config``: the launch configuration of all (None:
    the kernel's default)."""
    from ingot.ops import reference as ref

    norm = prologue.startswith("norm")
    cols = k if norm else 2 * k
    x = torch.randn(m, cols, generator=gen).to(torch.bfloat16).to(device)
    residual = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    norm_w = (1 + 0.3 * torch.randn(k, generator=gen)).to(torch.bfloat16).to(device)
    b = torch.randn(n, generator=gen).to(torch.bfloat16).to(device) if bias else None

    def run(w, b):
        if prologue == "norm":
            return *mod.rms_norm_linear(x, residual, norm_w, 1e-6, w, b, config), None, None
        if prologue == "norm_scaled":
            return mod.rms_norm_linear_scaled(x, residual, norm_w, 1e-6, w, b, config)
        fused = mod.silu_mul_linear if prologue == "silu" else mod.gelu_tanh_mul_linear
        return fused(x, w, b, config), None, None, None

    def expected_input():
        if norm:
            return ref.add_rms_norm(x.cpu(), residual.cpu(), norm_w.cpu(), 1e-6)
        if prologue == "silu":
            return ref.silu_and_mul(x.cpu()), None
        from ingot.ops.reference_geglu import gelu_tanh_and_mul

        return gelu_tanh_and_mul(x.cpu()), None

    h, new_residual = expected_input()
    w = (0.05 * torch.randn(n, k, generator=gen)).to(torch.bfloat16).to(device)
    y, r_out, hw, rstd = run(w, b)
    expected = torch.nn.functional.linear(h.float(), w.float().cpu(), None if b is None else b.float().cpu())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y.cpu(), expected) < 1e-2
    if norm:
        assert torch.equal(r_out.cpu(), new_residual)  # x + residual, every row and column written
    if prologue == "norm_scaled":
        _, _, hw_ref, rstd_ref = ref.rms_norm_linear_scaled(x.cpu(), residual.cpu(), norm_w.cpu(), 1e-6, w.cpu(), None)
        assert hw.dtype == torch.bfloat16 and torch.equal(hw.cpu(), hw_ref)  # norm_w * s, rounded alike
        assert rstd.dtype == torch.float32 and rstd.shape == (m,)
        torch.testing.assert_close(rstd.cpu(), rstd_ref, rtol=1e-5, atol=0)  # sums of squares in another order
        assert rel_err((hw.float() * rstd[:, None]).cpu(), h.float()) < 1e-2  # the two factors make the normed row
    eye = torch.eye(k, dtype=torch.bfloat16, device=device)
    same = run(eye, None)[0]
    if prologue == "silu":  # the activation rounds as the reference does
        assert torch.equal(same.cpu(), h)
    else:  # rstd scales after the sum (skinny_gemm.py), gelu's tanh is a sigmoid: bf16-rounding-level differences
        assert rel_err(same.cpu(), h) < 1e-2


def check_linear_norm_router(mod, m: int, n: int, k: int, experts: int, bias: bool, gen, device="cpu", config=None) -> None:
    """``linear_norm_linear_scaled`` of module ``mod`` (skinny_gemm): a projection of ``m`` rows
    joining the residual stream, then a MoE layer's norm and router. Its new residual is the
    same module's plain GEMM (same ``config``, so the same sums) plus the residual, bit for
    bit; ``norm_w * s`` is that residual times the norm weight, rounded alike; rstd and the
    logits match the hand computation from them, and the reference op within bf16 tolerance."""
    from ingot.ops import reference as ref

    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    w = (0.05 * torch.randn(n, k, generator=gen)).to(torch.bfloat16).to(device)
    b = torch.randn(n, generator=gen).to(torch.bfloat16).to(device) if bias else None
    residual = torch.randn(m, n, generator=gen).to(torch.bfloat16).to(device)
    norm_w = (1 + 0.3 * torch.randn(n, generator=gen)).to(torch.bfloat16).to(device)
    router = (0.1 * torch.randn(experts, n, generator=gen)).to(torch.bfloat16).to(device)
    logits, s, hw, rstd = mod.linear_norm_linear_scaled(x, w, b, residual, norm_w, 1e-6, router, config)
    assert logits.shape == (m, experts) and logits.dtype == torch.bfloat16
    assert s.shape == hw.shape == (m, n) and rstd.shape == (m,) and rstd.dtype == torch.float32
    assert torch.equal(s, mod.skinny_linear(x, w, b, config=config) + residual)
    assert torch.equal(hw, norm_w * s)
    expected_rstd = torch.rsqrt(s.float().pow(2).mean(-1) + 1e-6)
    torch.testing.assert_close(rstd, expected_rstd, rtol=1e-5, atol=0)  # sums of squares in another order
    by_hand = torch.nn.functional.linear(hw.float(), router.float()) * expected_rstd[:, None]
    assert rel_err(logits.cpu(), by_hand.cpu()) < 1e-2
    cpu = [t.cpu() if t is not None else None for t in (x, w, b, residual, norm_w)]
    ref_logits, ref_s, _, ref_rstd = ref.linear_norm_linear_scaled(*cpu, 1e-6, router.cpu())
    assert rel_err(logits.cpu(), ref_logits) < 2e-2 and rel_err(s.cpu(), ref_s) < 1e-2
    torch.testing.assert_close(rstd.cpu(), ref_rstd, rtol=1e-2, atol=0)


def prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen, dtype=torch.bfloat16, device="cpu", extra_cols=1):
    """Arguments of ``prefill_attention`` (without the scale): sequence ``b`` has ``ctx_lens[b]``
    tokens, its last ``q_lens[b]`` new (packed in q/k/v, and already stored in the cache, as
    the model stores them before attention); the earlier ones only in the cache."""
    from ingot.ops import reference as ref

    k_cache, v_cache, table = paged(ctx_lens, page, hkv, d, dtype, gen, extra_cols)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    slots = []
    for b, (n, total) in enumerate(zip(q_lens, ctx_lens)):
        for pos in range(total - n, total):
            slots.append(int(table[b, pos // page]) * page + pos % page)
    ref.store_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64))
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    return [a.to(device) for a in (q, k, v, k_cache, v_cache, cu, seq_lens, table)]


def mixed_prefill_lens(batch: int, max_new: int, max_ctx: int, gen) -> tuple[list, list]:
    """(new tokens, total tokens) per sequence: about half the sequences with a cached
    prefix (chunked prefill, prefix cache), the rest without; edge cases first (one new
    token after a prefix, a one-token prompt, a sequence ending on a 16-token block)."""
    q_lens, ctx_lens = [], []
    for b in range(batch):
        n = int(torch.randint(1, max_new + 1, (1,), generator=gen))
        prefix = int(torch.randint(1, max_ctx + 1, (1,), generator=gen)) if b % 2 else 0
        if b == 1:
            n = 1
        elif b == 2:
            n, prefix = 1, 0
        elif b == 3:
            n, prefix = min(max_new, 16), min(max_ctx, 48)  # ends on a 16-token block
        q_lens.append(n)
        ctx_lens.append(prefix + n)
    return q_lens, ctx_lens


def varlen_attention_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, seqused_k=None, padded_lse=False):
    """A CPU stand-in for PyTorch's flash varlen forward (``prefill_dispatch.flash_varlen``):
    (out in q's dtype, natural-log log-sum-exp ``[Hq, T]``, or ``[B, Hq, max_q]`` with
    ``padded_lse`` as older flash returns it), causal bottom-right, GQA; computed in fp32.
    It asserts the contract flash relies on (int32 offsets, length bounds), so a wrong
    bound in the caller fails here."""
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    q_starts, k_starts = cu_q.tolist(), cu_k.tolist()
    assert len(q_starts) == len(k_starts)
    used = None if seqused_k is None else seqused_k.tolist()
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.zeros(hq, q.shape[0])
    padded = torch.zeros(len(q_starts) - 1, hq, max_q)
    for b in range(len(q_starts) - 1):
        nq = q_starts[b + 1] - q_starts[b]
        nk = k_starts[b + 1] - k_starts[b]
        if used is not None:
            assert used[b] <= nk
            nk = used[b]
        assert 0 < nq <= max_q and nq <= nk <= max_k
        qs = q[q_starts[b] : q_starts[b] + nq].float().transpose(0, 1)
        ks = k[k_starts[b] : k_starts[b] + nk].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        vs = v[k_starts[b] : k_starts[b] + nk].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        s = qs @ ks.transpose(1, 2) * scale
        visible = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        out[q_starts[b] : q_starts[b] + nq] = (torch.softmax(s, -1) @ vs).transpose(0, 1).to(q.dtype)
        lse[:, q_starts[b] : q_starts[b] + nq] = torch.logsumexp(s, -1)
        padded[b, :, :nq] = torch.logsumexp(s, -1)
    return out, (padded if padded_lse else lse)


def cudnn_sdpa_reference(q, k, v, scale, lse=True):
    """A CPU stand-in for PyTorch's dense cuDNN attention (``prefill_dispatch.cudnn_sdpa``):
    q [B, Hq, S, D], k/v [B, Hkv, S, D], causal; (out laid out like q, natural-log
    log-sum-exp ``[B, Hq, S, 1]``, or an empty tensor without ``lse``, as cuDNN returns)."""
    hq, hkv, s_len = q.shape[1], k.shape[1], q.shape[2]
    ks = k.float().repeat_interleave(hq // hkv, 1)
    vs = v.float().repeat_interleave(hq // hkv, 1)
    s = q.float() @ ks.transpose(-1, -2) * scale
    visible = torch.arange(s_len)[None, :] <= torch.arange(s_len)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    out = torch.empty_like(q)
    out.copy_(torch.softmax(s, -1) @ vs)
    return out, (torch.logsumexp(s, -1).unsqueeze(-1) if lse else torch.empty(0))
