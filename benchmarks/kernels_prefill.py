"""Prefill attention rows of ``python -m benchmarks.kernels``: the op as dispatched, each of its
paths and PyTorch's attention on the same shapes, and one verdict line per shape."""

from __future__ import annotations

import torch

from benchmarks.kernel_timing import BF16, DEV
from benchmarks.kernels_decode import paged_cache
from ingot.ops import reference as ref

PREFILL_PATHS = ("triton", "flash", "cudnn", "gather")  # ingot/ops/triton/prefill_dispatch.py


# the kernel rows' shapes (q_lens, ctx_lens, Hq, Hkv, D): one 4096-token prompt; 8 chunks of 512
# new tokens after 1536 cached ones; 8 prompts of 512
PREFILL_SHAPES = {
    "T4096 causal 28/4 d128": ([4096], [4096], 28, 4, 128),
    "8x(512 new | 2048 ctx) 28/4": ([512] * 8, [2048] * 8, 28, 4, 128),
    "8x512 causal 28/4 d128": ([512] * 8, [512] * 8, 28, 4, 128),
}


def prefill_call(q_lens, ctx_lens, hq, hkv, d, page=16):
    """(the op's arguments, FLOPs): sequence ``b`` holds ``ctx_lens[b]`` tokens, its last
    ``q_lens[b]`` new (random K/V, also stored in the cache where the model stores them)."""
    batch = len(q_lens)
    k_cache, v_cache, table = paged_cache(batch, max(ctx_lens), hkv, d, page)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, dtype=BF16, device=DEV)
    k = torch.randn(t, hkv, d, dtype=BF16, device=DEV)
    v = torch.randn(t, hkv, d, dtype=BF16, device=DEV)
    pos = torch.cat([torch.arange(c - n, c) for n, c in zip(q_lens, ctx_lens)]).to(DEV)
    seq = torch.repeat_interleave(torch.arange(batch), torch.tensor(q_lens)).to(DEV)
    ref.store_kv(k, v, k_cache, v_cache, table[seq, pos // page].long() * page + pos % page)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    flops = sum(4 * n * (c - n) + 2 * n * n for n, c in zip(q_lens, ctx_lens)) * hq * d
    return (q, k, v, k_cache, v_cache, cu, seq_lens, table, d**-0.5), flops


def prefill_shape_args(call) -> tuple:
    """(tokens, sequences, capacity, Hq, Hkv, D, dtype, device): what the launch rule sees."""
    q, k, k_cache, table = call[0], call[1], call[3], call[7]
    return q.shape[0], table.shape[0], table.shape[1] * k_cache.shape[1], q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device


def _try_record(record, name, shape, fn, flops):
    """``record`` a row (with host time) unless ``fn`` fails, as for a backend this torch or
    GPU lacks: None then."""
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a missing backend must not end the run
        print(f"# {name} skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        return None
    return record(name, shape, fn, None, flops=flops, host=True)


def prefill_rows(record) -> list:
    """Per PREFILL_SHAPES shape: the op as dispatched (``prefill_attention``), each path it can
    take (``prefill [path]``), and PyTorch's attention on the same shape."""
    from ingot.ops.triton import prefill_attention as kernels
    from ingot.ops.triton import prefill_dispatch as pd

    groups = []
    for label, (q_lens, ctx_lens, hq, hkv, d) in PREFILL_SHAPES.items():
        call, flops = prefill_call(q_lens, ctx_lens, hq, hkv, d)
        shape_args = prefill_shape_args(call)
        chosen = pd.choose_prefill_path(*shape_args)
        print(f"# {label}: the op runs [{chosen}] (PREFILL_RULES[{pd.prefill_class(*shape_args[:3])}]); "
              f"fused kernel tiles {kernels.launch_config(d, call[0].device)}")
        op = record("prefill_attention", label, lambda c=call: pd.prefill_attention(*c),
                    lambda c=call: ref.prefill_attention(*c), flops=flops, target=35 if len(q_lens) == 1 else None, host=True)
        paths = {}
        for path in PREFILL_PATHS:
            if not pd.path_supported(path, *shape_args):
                print(f"# prefill [{path}] cannot run {label} here (prefill_dispatch.path_supported)")
                continue
            row = _try_record(record, f"prefill [{path}]", label, lambda c=call, p=path: pd.prefill_attention(*c, path=p), flops)
            if row is not None:
                paths[path] = row
        groups.append(dict(shape=label, chosen=chosen, op=op, paths=paths, **_sdpa_rows(record, label, call, q_lens, ctx_lens, flops)))
        del call
        torch.cuda.empty_cache()
    return groups


def _sdpa_backend(q, k, v, scale) -> str:
    """The backend ``scaled_dot_product_attention`` picks for these causal GQA inputs."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, scale=scale, enable_gqa=True)).name
    except Exception as exc:  # noqa: BLE001 - informative only
        return f"unknown ({type(exc).__name__})"


def _sdpa_rows(record, label, call, q_lens, ctx_lens, flops) -> dict:
    """PyTorch's attention on a PREFILL_SHAPES shape (equal lengths). Without a cached prefix:
    ``scaled_dot_product_attention`` on ``[B, H, n, D]`` views of the packed tokens with the
    backend PyTorch picks (``torch sdpa (context)``, the row the verdict compares against),
    then each backend forced. With a cached
    prefix: SDPA over contiguous K/V with a lower-right causal mask (``causal_lower_right``,
    the row compared against), and flash's varlen forward over the same contiguous K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_fn = torch.nn.functional.scaled_dot_product_attention
    q, k, v, cu, scale = call[0], call[1], call[2], call[5], call[8]
    batch, n, hq, hkv, d = len(q_lens), q_lens[0], q.shape[1], k.shape[1], q.shape[2]
    assert len(set(q_lens)) == 1 and len(set(ctx_lens)) == 1, "the SDPA rows take equal lengths"
    if q_lens == ctx_lens:
        qd, kd, vd = (t.view(batch, n, t.shape[1], d).transpose(1, 2) for t in (q, k, v))

        def sdpa():
            return sdpa_fn(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)

        print(f"# torch sdpa picks {_sdpa_backend(qd, kd, vd, scale)} for {label}")
        compare = _try_record(record, "torch sdpa (context)", label, sdpa, flops)
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            def forced(b=getattr(SDPBackend, backend)):
                with sdpa_kernel(b):
                    return sdpa()

            _try_record(record, f"torch sdpa [{backend.split('_')[0].lower()}]", label, forced, flops)
        return dict(compare=compare)
    from torch.nn.attention.bias import causal_lower_right

    ctx = ctx_lens[0]
    qd = torch.randn(batch, hq, n, d, dtype=BF16, device=DEV)
    kd = torch.randn(batch, hkv, ctx, d, dtype=BF16, device=DEV)
    vd = torch.randn(batch, hkv, ctx, d, dtype=BF16, device=DEV)
    bias = causal_lower_right(n, ctx)

    def lower_right():
        return sdpa_fn(qd, kd, vd, attn_mask=bias, scale=scale, enable_gqa=True)

    compare = _try_record(record, "torch sdpa lower-right", label, lower_right, flops)
    if compare is None:  # a torch whose CausalBias dispatch takes no enable_gqa
        ke, ve = kd.repeat_interleave(hq // hkv, 1), vd.repeat_interleave(hq // hkv, 1)
        compare = _try_record(record, "torch sdpa lower-right (K/V repeated)", label,
                              lambda: sdpa_fn(qd, ke, ve, attn_mask=bias, scale=scale), flops)
    kp, vp = (t.transpose(1, 2).reshape(batch * ctx, hkv, d) for t in (kd, vd))
    cu_k = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device=DEV)

    def flash_varlen():
        return torch.ops.aten._flash_attention_forward(q, kp, vp, cu, cu_k, n, ctx, 0.0, True, False, scale=scale)

    _try_record(record, "torch flash varlen", label, flash_varlen, flops)
    return dict(compare=compare)


def run_spread(row: dict) -> float:
    """The spread of a row's passes, (slowest - fastest) / median: how far apart two timings of
    one kernel fall on this GPU, so a difference inside it is no difference."""
    runs = row.get("ms_runs") or [row["ms"]]
    return (max(runs) - min(runs)) / row["ms"]


def prefill_shape_verdicts(groups: list) -> list:
    """One line per PREFILL_SHAPES shape, on the rows' median times: what the op runs and the
    fastest path, each against PyTorch's row ('at or above' = no slower; 'tie' = slower by less
    than the PyTorch row's own spread between passes, as when both run the same kernel)."""
    print("\n# prefill verdicts (medians; 'AT OR ABOVE' = no slower than the PyTorch row of the same shape, "
          "'TIE' = slower within that row's own spread between passes)")
    out = []
    for g in groups:
        op, sdpa = g["op"], g["compare"]
        best_path, best = min(g["paths"].items(), key=lambda kv: kv[1]["ms"]) if g["paths"] else (g["chosen"], op)
        if sdpa is None:
            print(f"# verdict {g['shape']}: no PyTorch row ran; the op [{g['chosen']}] {op['ms']:.4f} ms, "
                  f"fastest path [{best_path}] {best['ms']:.4f} ms")
            out.append(dict(shape=g["shape"], op_path=g["chosen"], op_ms=op["ms"], best_path=best_path, best_ms=best["ms"]))
            continue

        spread = run_spread(sdpa)

        def state(row):
            word = "AT OR ABOVE" if row["ms"] <= sdpa["ms"] else "TIE" if row["ms"] <= sdpa["ms"] * (1 + spread) else "BELOW"
            return f"{word} ({sdpa['ms'] / row['ms']:.3f}x)"

        print(f"# verdict {g['shape']}: the op [{g['chosen']}] {op['ms']:.4f} ms ({op['pct_of_ceiling']:.1f}% of matmul) "
              f"{state(op)} {sdpa['kernel']} {sdpa['ms']:.4f} ms ({sdpa['pct_of_ceiling']:.1f}%); "
              f"fastest path [{best_path}] {best['ms']:.4f} ms {state(best)}")
        out.append(dict(shape=g["shape"], op_path=g["chosen"], op_ms=op["ms"], sdpa_row=sdpa["kernel"], sdpa_ms=sdpa["ms"],
                        best_path=best_path, best_ms=best["ms"], op_at_or_above=op["ms"] <= sdpa["ms"],
                        best_at_or_above=best["ms"] <= sdpa["ms"], sdpa_spread=spread,
                        op_within_spread=op["ms"] <= sdpa["ms"] * (1 + spread)))
    return out
