"""The in-step launch sweep swaps one launch into the tables the ops read, and puts the table back."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import step_launch_sweep as sweep  # noqa: E402
from ingot.ops.triton import decode_attention as attention  # noqa: E402
from ingot.ops.triton import fused_moe as moe  # noqa: E402
from ingot.ops.triton import skinny_gemm as skinny  # noqa: E402

CPU = torch.device("cpu")


def test_skinny_candidate_changes_wide_batch1_projections_only_and_undoes():
    table = skinny.launch_config
    before = {(m, n, k, p): table(m, n, k, CPU, p) for m, n, k, p in
              ((1, 5120, 2048, skinny.NORM), (1, 2048, 4096, skinny.NONE), (1, 128, 2048, skinny.NONE), (4, 5120, 2048, skinny.NONE))}
    undo = sweep.skinny_candidates()["skinny: whole K, half-height tiles"]()
    try:
        assert skinny.launch_config(1, 2048, 4096, CPU).splits == 1 and skinny.launch_config(1, 2048, 4096, CPU).block_n == 8
        # the norm prologue's tiles are twice as tall, as in the table
        assert skinny.launch_config(1, 5120, 2048, CPU, skinny.NORM).block_n == 16
        assert skinny.launch_config(1, 128, 2048, CPU) == before[(1, 128, 2048, skinny.NONE)]  # the router keeps its launch
        assert skinny.launch_config(4, 5120, 2048, CPU) == before[(4, 5120, 2048, skinny.NONE)]  # more rows too
    finally:
        undo()
    assert skinny.launch_config is table


def test_moe_candidates_swap_the_one_token_row_and_undo():
    rows = moe._TABLE["sm90"][(8, 14336)]
    cands = sweep.moe_candidates(8, 14336)
    assert "moe down: (16, 256, 4, 4)" in cands and "moe down: (8, 512, 4, 4)" not in cands  # the table's own is not a candidate
    undo = cands["moe down: (16, 256, 4, 4)"]()
    try:
        launch = moe.launch_config(8, 14336, 1, CPU)
        assert launch.down == (16, 256, 4, 4) and launch.gate_up == rows[0][1].gate_up
        assert moe.launch_config(8, 14336, 2, CPU) == rows[1][1]  # other token counts keep their rows
    finally:
        undo()
    assert moe._TABLE["sm90"][(8, 14336)] is rows
    assert sweep.moe_candidates(1, 1) == {}  # a shape without a row of its own


def test_router_candidate_changes_batch1_routers_only_and_undoes():
    table = skinny.launch_config
    wide = table(1, 5120, 2048, CPU)
    undo = sweep.skinny_candidates("router")["router: whole K, 4-row tiles"]()
    try:
        for n, k in ((128, 2048), (8, 4096), (61, 2048)):  # Qwen3-30B-A3B, Mixtral-8x7B, Qwen1.5-MoE (+ shared gate)
            cfg = skinny.launch_config(1, n, k, CPU)
            assert (cfg.splits, cfg.block_n) == (1, 4) and cfg.block_k == table(1, n, k, CPU).block_k
        assert skinny.launch_config(1, 5120, 2048, CPU) == wide  # the wide projections keep theirs
        assert skinny.launch_config(2, 128, 2048, CPU) == table(2, 128, 2048, CPU)
    finally:
        undo()
    assert skinny.launch_config is table


def test_o_router_candidate_changes_the_router_epilogue_launch_only_and_undoes():
    table = skinny.launch_config
    plain = table(1, 2048, 4096, CPU)
    undo = sweep.skinny_candidates("o_router")["o_router: 64-row tiles"]()
    try:
        for n, k in ((2048, 4096), (4096, 4096)):  # o_proj of Qwen3-30B-A3B, Mixtral-8x7B
            cfg = skinny.launch_config(1, n, k, CPU, router=True)
            assert cfg.block_n == 64 and cfg.block_k == table(1, n, k, CPU).block_k
        assert skinny.launch_config(1, 2048, 4096, CPU) == plain  # the same projection without a router
        assert skinny.launch_config(1, 5120, 2048, CPU, skinny.NORM) == table(1, 5120, 2048, CPU, skinny.NORM)
        assert skinny.launch_config(4, 2048, 4096, CPU, router=True) == table(4, 2048, 4096, CPU)  # more rows
    finally:
        undo()
    assert skinny.launch_config is table
    # the table runs the plain one-row launch for it with 32-row tiles, the shares in 8,192-float rounds
    assert table(1, 2048, 4096, CPU, router=True) == replace(plain, block_n=32, share_block=8192)


def test_attention_candidate_changes_latency_bound_launches_only_and_undoes():
    table = attention.launch_config
    few, many = 4, 10_000  # (sequence, KV head) programs: batch 1 of 4 KV heads; a large batch
    undo = sweep.attention_candidates()["attention: 32-token tiles, 4 warps"]()
    try:
        cfg = attention.launch_config(128, few, CPU)
        assert (cfg.block_n, cfg.num_warps) == (32, 4) and cfg.num_stages == table(128, few, CPU).num_stages
        assert attention.launch_config(128, many, CPU) == table(128, many, CPU)
    finally:
        undo()
    assert attention.launch_config is table


def test_only_keeps_the_table_and_the_candidates_named():
    cands = {"table": None, **sweep.skinny_candidates("o_router"), **sweep.attention_candidates()}
    kept = sweep.keep_matching(cands, ["row tiles", "attention: 3 stages"])
    assert list(kept) == ["table", "o_router: 16-row tiles", "o_router: 64-row tiles", "attention: 3 stages"]
    assert list(sweep.keep_matching(cands, ["no such launch"])) == ["table"]


def test_graph_step_us_times_a_fresh_capture_and_drops_it():
    """One capture per call, timed once (or again until ``until``), always dropped afterwards."""
    import time

    class Runner:
        device = CPU

        def __init__(self):
            self.captured, self.dropped, self.replays = [], [], 0

        def decode_variant(self, config, per_seq):
            self.captured.append((config, per_seq))
            return object()

        def logits_of(self, graphs, inputs):
            self.replays += 1

        def drop_variant(self, graphs):
            self.dropped.append(graphs)

    r = Runner()
    assert sweep.graph_step_us(r, "graph config", 7, None, steps=3) >= 0.0
    assert r.captured == [("graph config", 7)] and len(r.dropped) == 1
    once = r.replays
    sweep.graph_step_us(r, "graph config", 7, None, steps=3, until=time.monotonic() + 0.05)
    assert len(r.captured) == 2 and len(r.dropped) == 2 and r.replays - once > once  # timed more than once


def test_pdl_candidates_switch_pdl_in_the_three_tables_and_undo(monkeypatch):
    for module in (skinny, attention, moe):  # as on an H200, where the tables ask for PDL
        monkeypatch.setattr(module, "pdl_supported", lambda device: True)
    tables = (skinny.launch_config, attention.launch_config, moe.launch_config)
    assert skinny.launch_config(1, 4096, 2048, CPU).pdl and attention.launch_config(128, 4, CPU).pdl
    cands = sweep.pdl_candidates()
    undo = cands["pdl: off"]()
    try:
        assert not skinny.launch_config(1, 4096, 2048, CPU).pdl
        assert not skinny.launch_config(1, 2048, 4096, CPU, router=True).pdl
        assert not attention.launch_config(128, 4, CPU).pdl
        assert not moe.launch_config(128, 768, 1, CPU).pdl
        assert skinny.launch_config(1, 4096, 2048, CPU).block_n == tables[0](1, 4096, 2048, CPU).block_n  # only pdl changes
    finally:
        undo()
    assert (skinny.launch_config, attention.launch_config, moe.launch_config) == tables
    undo = cands["pdl: not attention"]()
    try:
        assert skinny.launch_config(1, 4096, 2048, CPU).pdl and moe.launch_config(128, 768, 1, CPU).pdl
        assert not attention.launch_config(128, 4, CPU).pdl
    finally:
        undo()
