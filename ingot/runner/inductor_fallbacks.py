"""Let Inductor meet every ``torch.ops.ingot`` op once on shallow inputs, before the model.

Inductor has no lowering for our custom ops; the first time a graph uses one,
``GraphLowering.call_function`` creates an implicit fallback for it and logs
that, and PyTorch up to 2.11 formats the log message eagerly (later versions
format it lazily). The message prints the op's IR arguments, and each IR node
prints its own inputs: for an op first met deep in a decode step whose layers
are chains of our opaque ops (the final norm after 30 layers of skinny GEMVs
with fused norms, SmolLM2 at batch 1), that string doubles per layer, and the
lowering of such a step never finishes (the outermost frames of a stack sampled
during the hang are that log call; a formatter that elides the arguments makes
the same step compile in seconds).

The fallback, once made, is process-wide (Inductor keeps one lowering per op),
so compiling one small function that calls each op on graph inputs, whose
description is a line each, makes every later graph take the fast path. This
uses only ``torch.compile``; it runs on CPU tensors (the reference kernels),
because the fallback does not depend on the device and CPU runs launch no
Triton compiles. The compile caches are off for it: a cache hit skips the
lowering, so no fallback would be made, while the model's own compile may
still miss the cache and lower.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from ingot.runner.compile_options import has_option

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_DONE = False


def _call_every_op(x: torch.Tensor, w: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                   positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   table: torch.Tensor, seq_lens: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> list[torch.Tensor]:
    """Each decode-path op once (prefill attention, dense or latent, never runs compiled)."""
    ops = torch.ops.ingot
    out = [ops.rms_norm(x, w, 1e-6), *ops.add_rms_norm(x, x, w, 1e-6), ops.silu_and_mul(x2), ops.gelu_tanh_and_mul(x2)]
    out += [*ops.rotary_embedding(positions, q, k, cos_sin)]
    ops.store_kv(k, v, k_cache, v_cache, slots)
    out.append(ops.decode_attention(q, k_cache, v_cache, table, seq_lens, 1.0, 2, 30.0))
    out.append(ops.decode_attention_rope(q, k, v, positions, cos_sin, k_cache, v_cache, slots, table, seq_lens, 1.0,
                                         None, None, 0.0, 2, 30.0))
    half = q.shape[-1] // 2  # latent attention: the cache entry as latent + rope key halves
    ops.mla_store_kv(k[:, 0, :half], k[:, 0, half:], k_cache, slots)
    out.append(ops.mla_decode_attention(q[..., :half], q[..., half:], k_cache, table, seq_lens, 1.0))
    out += [ops.skinny_linear(x, weight, None), *ops.rms_norm_linear(x, x, w, 1e-6, weight, None)]
    out += [*ops.rms_norm_linear_scaled(x, x, w, 1e-6, weight, None)]
    out += [*ops.linear_norm_linear_scaled(x, w_gate_up[0], None, x, w, 1e-6, weight)]
    out += [ops.silu_mul_linear(x2, weight, None), ops.gelu_tanh_mul_linear(x2, weight, None)]
    out.append(ops.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids))
    out.append(ops.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, topk_weights[:, 0].float()))
    qweight = torch.zeros(weight.shape[0], weight.shape[1] // 8, dtype=torch.int32)  # int4, one group per row
    out.append(ops.int_linear(x, qweight, weight[:, :1], None, None, None, 4, weight.shape[1], 8))
    out.append(ops.fp8_linear(x, weight.to(torch.float8_e4m3fn), w[:1, None].float(), None, 0, 0, -1))
    out.append(ops.fused_moe_int(x, w_gate_up.int()[..., :2], w_gate_up[..., :1], None, None, w_down.int()[..., :1],
                                 w_down[..., :1], None, None, topk_weights, topk_ids, 8, 0, 128))  # int8, per row
    out.append(ops.fused_moe_fp8(x, w_gate_up.to(torch.float8_e4m3fn), w_gate_up[..., :1].float(),
                                 w_down.to(torch.float8_e4m3fn), w_down[..., :1].float(), topk_weights, topk_ids, 1, 0, -1))
    return out


def _example_inputs() -> list[torch.Tensor]:
    hidden, heads, head_dim, page = 8, 2, 8, 4
    x = torch.randn(1, hidden)
    k_cache = torch.zeros(2, page, 1, head_dim)
    return [
        x, torch.ones(hidden), torch.randn(1, 2 * hidden), torch.randn(4, hidden),
        torch.zeros(1, dtype=torch.int64), torch.randn(page, head_dim),
        torch.randn(1, heads, head_dim), torch.randn(1, 1, head_dim), torch.randn(1, 1, head_dim),
        k_cache, k_cache.clone(), torch.tensor([page], dtype=torch.int64),
        torch.tensor([[1]], dtype=torch.int32), torch.ones(1, dtype=torch.int32),
        torch.randn(2, 2 * 4, hidden), torch.randn(2, hidden, 4), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.int64),
    ]


# (config module, option): the local and remote FX-graph and AOTAutograd caches
_CACHES = (("torch._inductor.config", "fx_graph_cache"), ("torch._inductor.config", "fx_graph_remote_cache"),
           ("torch._functorch.config", "enable_autograd_cache"),
           ("torch._functorch.config", "enable_remote_autograd_cache"))


def _caches_off() -> contextlib.ExitStack:
    """Turn off, for one compile, every compile cache the installed PyTorch has."""
    import importlib

    stack = contextlib.ExitStack()
    for module, name in _CACHES:
        config = importlib.import_module(module)
        if has_option(config, name):
            stack.enter_context(config.patch(name, False))
    return stack


def register_op_fallbacks() -> bool:
    """Compile ``_call_every_op`` once per process with Inductor; True when it ran now.

    A failure only costs the protection (logged); the decode compile goes on.
    """
    global _DONE
    with _LOCK:
        if _DONE:
            return False
        _DONE = True
        try:
            fn = torch.compile(_call_every_op, backend="inductor", fullgraph=True, dynamic=False)
            with torch.no_grad(), _caches_off():
                fn(*_example_inputs())
        except Exception as exc:  # noqa: BLE001 - an optimisation of compile time, never fatal
            log.warning("could not pre-register Inductor fallbacks for the ingot ops (%s: %s); on PyTorch "
                        "<= 2.11 compiling a deep decode step may then take minutes",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return True


def _reset_for_tests() -> None:
    global _DONE
    _DONE = False
