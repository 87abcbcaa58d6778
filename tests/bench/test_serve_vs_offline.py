"""benchmarks/serve_vs_offline.py: the server and the offline engine on one workload, alternated.

Runs the real thing on the CPU with the default model: ``ingot serve`` as a subprocess on a
free port and an offline engine in this process, a warm-up round and a counted one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import serve_vs_offline as svo
from ingot.bench.serve import Workload, make_requests


def _serve_children() -> list[int]:
    """This process's children that run ``ingot serve`` (Linux /proc)."""
    me, found = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid == me and b"serve" in cmd and b"ingot" in cmd:
            found.append(int(pid))
    return found


def test_rounds_alternate_and_compare_the_same_work(tmp_path):
    doc = svo.main(["--num-requests", "3", "--input-len", "8-12", "--output-len", "3-5", "--rounds", "1",
                    "--warmup-rounds", "1", "--max-model-len", "256", "--seed", "7", "--startup-timeout", "180", "--json", str(tmp_path / "r.json")])
    rounds = doc["rounds"]
    assert [(r["round"], r["warmup"], r["order"]) for r in rounds] == [
        (0, True, ["offline", "http"]), (1, False, ["http", "offline"])]
    vocab = 49152  # the default model's vocabulary
    for r in rounds:
        expected = sum(q.output_len for q in make_requests(Workload(3, (8, 12), (3, 5), seed=7 + r["round"]), vocab))
        assert r["offline"]["output_tokens"] == r["http"]["output_tokens"] == expected  # ignore_eos: all of them
        assert r["ratio"] == pytest.approx(r["http"]["output_throughput"] / r["offline"]["output_throughput"])
        for mode in ("offline", "http"):
            assert r[mode]["output_throughput"] == pytest.approx(expected / r[mode]["duration_s"])
            for key in ("ttft_ms", "tpot_ms", "itl_ms"):  # both ways, every percentile
                stats = r[mode][key]
                assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
            assert r[mode]["tpot_p50_ms"] == r[mode]["tpot_ms"]["p50"]
    assert doc["median_ratio"] == pytest.approx(rounds[1]["ratio"])  # warm-up rounds do not count
    assert (tmp_path / "r.json").exists()
    assert _serve_children() == [], "the server subprocess is stopped"


def test_a_server_that_cannot_start_is_an_error_and_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="ingot serve exited with code"):
        svo.main(["--model", str(tmp_path / "missing.gguf"), "--rounds", "1", "--startup-timeout", "120"])
    assert _serve_children() == []
