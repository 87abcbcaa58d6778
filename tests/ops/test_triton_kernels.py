"""Registering the Triton CUDA kernels, and dispatch through ``torch.ops.ingot.*`` after
``register_cuda_kernels()`` (marked cuda; run on the GPU), against ingot.ops.reference.

Two CPU tests (unmarked) check ``register_cuda_kernels()`` without CUDA. The kernels
themselves: test_decode_kernels_cuda.py, test_elementwise_kernels_cuda.py,
test_skinny_gemm_cuda.py and test_prefill_kernels_cuda.py (harness: gpu_fixtures.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from ingot.ops import reference as ref
from tests.ops.gpu_fixtures import BF16, HAS_CUDA, TOL, K, fp32, gpu, paged, prefill_case  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_rope_decode, rel_err, rope_decode_case


def test_register_without_cuda_does_not_raise_or_import_triton():
    code = (
        "import sys; from ingot.ops.triton import register_cuda_kernels as r; "
        "ok = r(); print(ok, 'triton' in sys.modules)"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]


def test_register_in_process_does_not_raise():
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels() in (True, False)
    if not HAS_CUDA:
        assert register_cuda_kernels() is False


@gpu
def test_ops_dispatch_to_triton(K):
    from ingot.ops import library  # noqa: F401  (defines torch.ops.ingot.*)
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels() is True
    assert register_cuda_kernels() is True  # idempotent
    ops = torch.ops.ingot
    gen = torch.Generator().manual_seed(21)
    poison = K.poison

    def ran_triton(fn):
        before = poison.allocs
        result = fn()
        assert poison.allocs > before, "the op did not reach the Triton implementation"
        return result

    x = torch.randn(9, 512, generator=gen).to(BF16).cuda()
    r = torch.randn(9, 512, generator=gen).to(BF16).cuda()
    w = torch.randn(512, generator=gen).to(BF16).cuda()
    assert rel_err(ran_triton(lambda: ops.rms_norm(x, w, 1e-6)), ref.rms_norm(x, w, 1e-6)) < TOL
    out, res = ran_triton(lambda: ops.add_rms_norm(x, r, w, 1e-6))
    exp_out, exp_res = ref.add_rms_norm(x, r, w, 1e-6)
    assert rel_err(out, exp_out) < TOL and torch.equal(res, exp_res)
    gu = torch.randn(9, 1024, generator=gen).to(BF16).cuda()
    assert rel_err(ran_triton(lambda: ops.silu_and_mul(gu)), ref.silu_and_mul(gu)) < TOL

    q = torch.randn(9, 8, 64, generator=gen).to(BF16).cuda()
    k = torch.randn(9, 2, 64, generator=gen).to(BF16).cuda()
    cache = torch.randn(64, 64, generator=gen).cuda()
    pos = torch.randint(0, 64, (9,), generator=gen).cuda()
    qo, ko = ran_triton(lambda: ops.rotary_embedding(pos, q, k, cache))
    qe, ke = ref.rotary_embedding(pos, q, k, cache)
    assert rel_err(qo, qe) < TOL and rel_err(ko, ke) < TOL

    # store_kv allocates nothing: check its effect instead
    kc = torch.zeros(4, 16, 2, 64, dtype=BF16, device="cuda")
    vc = kc.clone()
    slots = torch.arange(16, 25, device="cuda")
    ops.store_kv(k, k, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 64)[16:25], k) and torch.equal(vc.view(-1, 2, 64)[16:25], k)

    args = prefill_case([20, 7], [50, 7], 8, 2, 64, 16, gen)
    out = ran_triton(lambda: ops.prefill_attention(*args, 0.125))
    assert rel_err(out, ref.prefill_attention(*fp32(args), 0.125)) < TOL

    kc, vc, table = paged([70, 1, 33], 16, 2, 64, BF16, gen)
    qd = torch.randn(3, 8, 64, generator=gen).to(BF16).cuda()
    sl = torch.tensor([70, 1, 33], dtype=torch.int32, device="cuda")
    out = ran_triton(lambda: ops.decode_attention(qd, kc, vc, table, sl, 0.125))
    assert rel_err(out, ref.decode_attention(qd.float(), kc.float(), vc.float(), table, sl, 0.125)) < TOL

    args = rope_decode_case([70, 33, 1], 8, 2, 64, 16, BF16, gen, device="cuda")
    check_rope_decode(lambda *a: ran_triton(lambda: ops.decode_attention_rope(*a)), args)
