"""The fused MoE kernels in the Triton interpreter against moe_cases' reference: per-pair and
grouped launches, routings, the launch table, and the expert alignment kernel.
Gated by tests/ops/interpret_fixtures.py, whose fixture ``MOE`` this file uses."""

from __future__ import annotations

import pytest
import torch

from tests.ops.interpret_fixtures import ENABLED, MOE, K  # noqa: F401  (the fixtures)
from tests.ops.moe_cases import ROUTINGS, check_fused_moe, expected_alignment, moe_inputs

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")

MOE_CASES = [
    # (tokens, experts, top_k, hidden, inter)
    (1, 8, 2, 64, 32),
    (5, 8, 3, 48, 40),  # widths not multiples of the tiles
    (20, 4, 2, 32, 16),
    (9, 16, 4, 64, 32),
    (3, 6, 1, 32, 24),
]


@pytest.mark.parametrize("grouped", [False, True], ids=["per_pair", "grouped"])
@pytest.mark.parametrize("t,e,k,h,i", MOE_CASES)
def test_fused_moe(MOE, grouped, t, e, k, h, i):
    launch = MOE.MoeLaunch(True, 16, (16, 16, 4, 1), (16, 32, 4, 1)) if grouped else MOE.MoeLaunch(False, 1, (16, 32, 4, 1), (16, 16, 4, 1))
    args = moe_inputs(t, e, k, h, i, torch.float32, torch.Generator().manual_seed(t * 31 + e), routing="random")
    check_fused_moe(lambda *a: MOE.run(*a, launch=launch), args, tol=1e-5)
    scale = torch.rand(t, generator=torch.Generator().manual_seed(t)) + 0.5  # each token's gate/up sums scaled
    check_fused_moe(lambda *a: MOE.run(*a, launch=launch), args + [scale], tol=1e-5)
    from ingot.ops.triton._common import _counters

    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())  # the per-pair sum's counters left at zero


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("grouped", [False, True], ids=["per_pair", "grouped"])
def test_fused_moe_routings_bf16(MOE, routing, grouped):
    """Every token on one expert (one expert's blocks hold all pairs), evenly spread routing,
    and fp32 routing weights (Mixtral) on bf16 activations."""
    launch = MOE.MoeLaunch(True, 16, (16, 16, 4, 1), (16, 16, 4, 1)) if grouped else MOE.PER_PAIR
    gen = torch.Generator().manual_seed(11)
    args = moe_inputs(18, 8, 2, 64, 32, torch.bfloat16, gen, routing=routing, fp32_weights=routing == "even")
    check_fused_moe(lambda *a: MOE.run(*a, launch=launch), args, tol=1e-2)
    if not grouped:  # the batch-1 launches of Qwen3-30B-A3B (8-row gate/up tiles) and Mixtral (8 x 512 down tiles)
        check_fused_moe(lambda *a: MOE.run(*a, launch=MOE.PER_PAIR_NARROW), args, tol=1e-2)
        check_fused_moe(lambda *a: MOE.run(*a, launch=MOE.PER_PAIR_LONG_K), args, tol=1e-2)


def test_fused_moe_table_path(MOE):
    """Without a launch the table decides (per pair at one token, grouped at many), both correct."""
    for t in (1, 40):
        args = moe_inputs(t, 128, 8, 32, 768 // 24, torch.float32, torch.Generator().manual_seed(t), routing="random")
        check_fused_moe(MOE.fused_moe, args, tol=1e-5)
    assert MOE.launch_config(128, 768, 1, torch.device("cpu")) == MOE.PER_PAIR_NARROW  # the H200 sweep's batch-1 choice
    assert MOE.launch_config(128, 768, 2, torch.device("cpu")) == MOE.PER_PAIR
    assert MOE.launch_config(128, 768, 16, torch.device("cpu")).grouped
    assert MOE.launch_config(8, 14336, 1, torch.device("cpu")) == MOE.PER_PAIR_LONG_K
    assert MOE.launch_config(8, 14336, 2, torch.device("cpu")).grouped


@pytest.mark.parametrize("t,e,k,bm", [(7, 5, 2, 16), (40, 3, 3, 16), (1, 8, 2, 16), (33, 64, 4, 32)])
def test_fused_moe_alignment(MOE, t, e, k, bm):
    """Each expert's pairs in pair order, padded with P to a multiple of the block, at its offset;
    each block's expert; blocks past the routing's last marked -1 (every entry written)."""
    ids = moe_inputs(t, e, k, 8, 8, torch.float32, torch.Generator().manual_seed(t + e), routing="random")[4]
    flat = ids.contiguous().view(-1)
    pairs = flat.numel()
    blocks = -(-(pairs + min(e, pairs) * (bm - 1)) // bm)
    sorted_ids = MOE.torch.empty(blocks * bm, dtype=torch.int32)
    block_expert = MOE.torch.empty(blocks, dtype=torch.int32)
    MOE._align_kernel[(e,)](flat, sorted_ids, block_expert, pairs, blocks, BLOCK_M=bm, CHUNK=16,
                            E_BINS=max(2, 1 << (e - 1).bit_length()), BLOCK_B=max(2, 1 << (-(-pairs // bm) - 1).bit_length()))
    want_sorted, want_blocks = expected_alignment(flat.tolist(), e, bm)
    used = len(want_blocks)
    assert sorted_ids[: used * bm].tolist() == want_sorted
    assert block_expert.tolist() == want_blocks + [-1] * (blocks - used)
