"""Attention sinks (gpt-oss) in the decode and prefill kernels, through the Triton interpreter,
against a dense softmax with the sink in its denominator written in tests/ops/window_cases.py,
and the references against it too. Gated by tests/ops/interpret_fixtures.py, whose fixture
``K`` this file reuses."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.interpret_fixtures import ENABLED, K  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_rope_decode, rel_err, rope_decode_case
from tests.ops.window_cases import decode_window_case, prefill_window_case

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")
CPU = torch.device("cpu")


def sinks(hq: int, seed: int) -> torch.Tensor:
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("lens,window,splits,merge_kernel", [
    ([1, 40, 70], 0, 1, False),  # one slice: the program normalises with the sink
    ([1, 40, 70], 24, 3, False),  # slices merged by the last program, a window
    ([33, 90], 0, 4, True),  # the separate merge kernel
])
def test_decode_attention_sinks(K, lens, window, splits, merge_kernel):  # noqa: F811
    gen = torch.Generator().manual_seed(sum(lens) + splits)
    args, expected = decode_window_case(lens, 4, 2, 32, 16, gen)
    s = sinks(4, splits)
    want = expected(window, 0.2, 0.0, s)
    assert rel_err(ref.decode_attention(*args, 0.2, window, 0.0, s), want) < 1e-5
    cfg = replace(K.decode_attention.launch_config(32, 2 * len(lens), CPU), merge_kernel=merge_kernel)
    out = K.decode_attention.decode_attention(*args, 0.2, window, 0.0, s, num_splits=splits, config=cfg)
    assert rel_err(out, want) < 1e-4


def test_decode_attention_rope_sinks(K):  # noqa: F811
    gen = torch.Generator().manual_seed(5)
    args = rope_decode_case([70, 33, 1], 4, 2, 32, 16, torch.bfloat16, gen)
    s = sinks(4, 5).to(torch.bfloat16)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=3),
                      [*args, None, None, 0.0, 20, 0.0, s])


@pytest.mark.parametrize("q_lens,totals,window", [
    ([5, 1, 12, 9], [21, 14, 12, 30], 6),  # chunks with cached prefixes, a window
    ([40, 20], [100, 20], 0),  # full attention over a cached prefix
])
def test_prefill_attention_sinks(K, q_lens, totals, window):  # noqa: F811
    gen = torch.Generator().manual_seed(sum(totals) + window)
    args, expected = prefill_window_case(q_lens, totals, 4, 2, 32, 8, gen)
    s = sinks(4, window)
    want = expected(window, 0.2, 0.0, s)
    assert rel_err(ref.prefill_attention(*args, 0.2, window, 0.0, s), want) < 1e-5
    cfg = K.prefill_attention.PrefillConfig(16, 8, 4, 1)
    assert rel_err(K.prefill_attention.prefill_attention(*args, 0.2, window, 0.0, s, config=cfg), want) < 1e-4
    out = K.prefill_dispatch.prefill_attention(*args, 0.2, window, 0.0, s, config=cfg)  # sinks: the fused kernel
    assert rel_err(out, want) < 1e-4
    assert K.prefill_dispatch.choose_prefill_path(64, 1, 64, 4, 2, 32, torch.bfloat16, CPU, sinks=True) == "triton"
