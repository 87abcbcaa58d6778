"""`ingot bench decode` on CPU: parsing, floor math, table / JSON / plot writers on fabricated rows."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from ingot.bench import decode_cli, report
from ingot.bench.decode import BucketTiming
from ingot.bench.decode_cli import DecodeBench, ModelBytes
from ingot.cli import build_parser, main


# ---------------------------------------------------------------------- parsing
def test_parse_defaults():
    args = build_parser().parse_args(["bench", "decode"])
    assert args.func is decode_cli.cmd_decode
    assert args.model is None and args.shape is None
    assert args.batch_sizes == [1, 8, 32, 64, 256]
    assert args.context_len == 512 and args.iters == 30
    assert args.decode_compile == "on"
    assert args.json is None and args.plot is None
    assert args.dtype == "auto" and args.device == "auto"


def test_parse_options():
    args = build_parser().parse_args([
        "bench", "decode", "--shape", "qwen2.5-7b", "--batch-sizes", "1, 8,8,64", "--context-len", "1024",
        "--decode-compile", "off", "--iters", "5", "--json", "o.json", "--plot", "o.png", "--dtype", "bfloat16",
        "--device", "cuda:1",
    ])
    assert args.shape == "qwen2.5-7b" and args.batch_sizes == [1, 8, 64]
    assert (args.context_len, args.decode_compile, args.iters) == (1024, "off", 5)
    assert (args.json, args.plot, args.dtype, args.device) == ("o.json", "o.png", "bfloat16", "cuda:1")
    assert build_parser().parse_args(["bench", "decode", "--model", "org/name"]).model == "org/name"
    assert build_parser().parse_args(["bench", "decode", "--decode-compile", "auto"]).decode_compile == "auto"


def test_parse_gemm_floor_and_profile():
    args = build_parser().parse_args(["bench", "decode"])
    assert args.gemm_floor is False and args.profile is None
    args = build_parser().parse_args(["bench", "decode", "--gemm-floor", "--profile"])
    assert args.gemm_floor is True and args.profile == 10
    assert build_parser().parse_args(["bench", "decode", "--profile", "3"]).profile == 3


@pytest.mark.parametrize("argv", [
    ["--batch-sizes", "0,8"],
    ["--batch-sizes", "a"],
    ["--batch-sizes", ""],
    ["--context-len", "0"],
    ["--shape", "gpt-5"],
    ["--decode-compile", "maybe"],
    ["--model", "x", "--shape", "qwen2.5-7b"],  # one or the other
])
def test_parse_rejects(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "decode", *argv])
    assert exc.value.code == 2


def test_modes_for():
    assert decode_cli.modes_for("off") == ["eager", "graph"]
    assert decode_cli.modes_for("on") == ["eager", "graph", "compiled"]
    assert decode_cli.modes_for("auto") == ["eager", "graph", "compiled", "auto"]


# ---------------------------------------------------------------------- floor math
MB = ModelBytes(weight_bytes=1_000_000_000, num_layers=2, num_kv_heads=2, head_dim=64, kv_elem_size=2)


def test_kv_bytes_by_hand():
    # 4 seqs * 100 tokens * 2 layers * (K and V) * 2 heads * 64 dims * 2 bytes
    assert MB.kv_bytes(4, 100) == 4 * 100 * 2 * 2 * 2 * 64 * 2 == 409_600
    assert MB.step_bytes(4, 100) == 1_000_409_600
    assert MB.kv_bytes(0, 100) == 0


def test_copy_bandwidth_counts_read_and_write():
    # 1 GiB copied in 0.5 ms: 2 GiB moved -> 4.294967296e12 B/s
    assert decode_cli.copy_bandwidth(1 << 30, 0.5) == pytest.approx(4.294967296e12)


def test_floor_ms_and_fraction_by_hand():
    floor = decode_cli.floor_ms(MB, 4, 100, 4e12)
    assert floor == pytest.approx(1_000_409_600 / 4e12 * 1e3) == pytest.approx(0.2501024)
    assert decode_cli.floor_fraction(floor, 0.5) == pytest.approx(0.5002048)
    assert decode_cli.tokens_per_s(8, 2.5) == pytest.approx(3200.0)


def test_floor_qwen_1_5b_shape_by_hand():
    # Qwen2.5-1.5B, bf16: 28 layers, 2 KV heads of 128; batch 64 at context 512
    mb = ModelBytes(weight_bytes=3_087_467_008, num_layers=28, num_kv_heads=2, head_dim=128, kv_elem_size=2)
    kv = 64 * 512 * 28 * 2 * 2 * 128 * 2
    assert mb.kv_bytes(64, 512) == kv == 939_524_096
    assert decode_cli.floor_ms(mb, 64, 512, 4.0e12) == pytest.approx((3_087_467_008 + kv) / 4.0e9)


def test_model_bytes_of_counts_tied_weights_once():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4, dtype=torch.bfloat16)
            self.head = torch.nn.Linear(4, 10, bias=False, dtype=torch.bfloat16)
            self.head.weight = self.embed.weight  # tied
            self.norm = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
            self.register_buffer("cache", torch.zeros(1000))  # buffers are not weights

    from ingot.loading.model_config import KVCacheEntry

    cfg = SimpleNamespace(num_layers=3, kv_cache_entry=KVCacheEntry(2, 8), layer_windows=())
    mb = ModelBytes.of(Tiny(), cfg, torch.bfloat16)
    assert mb == ModelBytes(weight_bytes=(40 + 4) * 2, num_layers=3, num_kv_heads=2, head_dim=8, kv_elem_size=2)
    latent = ModelBytes.of(Tiny(), SimpleNamespace(num_layers=3, kv_cache_entry=KVCacheEntry(1, 576, False), layer_windows=()), torch.bfloat16)
    assert latent.kv_bytes(1, 1) == 3 * 576 * 2  # one cache entry per token and layer, no separate V


# ---------------------------------------------------------------------- writers on fabricated rows
def fabricated(modes=("eager", "graph", "compiled")) -> DecodeBench:
    rows = [
        BucketTiming(1, ms={"eager": 16.5, "graph": 1.8, "compiled": 1.6},
                     back_to_back_ms={"eager": 16.4, "graph": 1.7, "compiled": 1.45},
                     warmup_s={"graph": 0.4, "compiled": 27.1}, capture_s={"graph": 0.011, "compiled": 0.013}),
        BucketTiming(8, ms={"eager": 18.0, "graph": 2.5, "compiled": 2.0},
                     back_to_back_ms={"eager": 17.9, "graph": 2.4, "compiled": 1.875},
                     warmup_s={"graph": 0.5, "compiled": 25.9}, capture_s={"graph": 0.012, "compiled": 0.014}),
    ]
    for r in rows:
        for d in (r.ms, r.back_to_back_ms, r.warmup_s, r.capture_s):
            for m in list(d):
                if m not in modes:
                    del d[m]
    return DecodeBench(source="shape qwen2.5-1.5b (random weights)", dtype="bfloat16", context_len=100, iters=30,
                       decode_compile="on", modes=list(modes), bandwidth=4e12, model_bytes=MB, rows=rows,
                       env={"gpu": "fabricated", "torch": torch.__version__})


def test_summarize():
    s = decode_cli.summarize(fabricated())
    assert [r["batch"] for r in s] == [1, 8]
    b8 = s[1]
    assert b8["kv_bytes"] == MB.kv_bytes(8, 100)
    assert b8["floor_ms"] == pytest.approx(decode_cli.floor_ms(MB, 8, 100, 4e12))
    assert b8["compiled_speedup_vs_graph"] == pytest.approx(2.5 / 2.0)
    assert b8["modes"]["graph"]["tokens_per_s"] == pytest.approx(3200.0)
    assert b8["modes"]["compiled"]["floor_fraction"] == pytest.approx(b8["floor_ms"] / 2.0)
    assert b8["modes"]["compiled"]["back_to_back_ms"] == 1.875
    assert b8["modes"]["compiled"]["back_to_back_floor_fraction"] == pytest.approx(b8["floor_ms"] / 1.875)
    assert b8["modes"]["eager"]["warmup_s"] is None
    assert b8["modes"]["compiled"]["warmup_s"] == 25.9 and b8["modes"]["compiled"]["capture_s"] == 0.014


def test_summarize_graph_minus_gemms():
    bench = fabricated(("eager", "graph"))
    bench.rows[0].ms["gemm_only"] = 1.25
    bench.modes.append("gemm_only")
    s = decode_cli.summarize(bench)
    assert s[0]["graph_minus_gemm_ms"] == pytest.approx(1.8 - 1.25)
    assert s[1]["graph_minus_gemm_ms"] is None  # no GEMM-only time at batch 8


def test_profile_lines():
    from ingot.bench.step_profile import StepProfile, kernel_family

    assert kernel_family("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "GEMM"
    assert kernel_family("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT") == "GEMM"
    assert kernel_family("_decode_kernel") == "_decode_kernel"
    bench = fabricated()
    bench.rows[0].profiles["graph"] = StepProfile([("GEMM", 113.0, 1200.0), ("_decode_kernel", 28.0, 216.0)])
    bench.rows[0].profiles["compiled"] = StepProfile([("triton_fused", 50.0, 1000.0)])
    lines = decode_cli.profile_lines(bench)
    # graph: 1.8 ms alone, 1.7 back to back: 1416 us of kernels, 284 us between them, 100 us of host
    assert lines[0] == ("batch 1, graph: step 1800.0 us alone, 1700.0 us back to back; kernels 1416.0 us "
                        "(141 launches), between kernels 284.0 us, host 100.0 us")
    assert lines[1:3] == ["    1200.0 us   113x  GEMM", "     216.0 us    28x  _decode_kernel"]  # heaviest first, as given
    assert lines[3] == ("batch 1, compiled: step 1600.0 us alone, 1450.0 us back to back; kernels 1000.0 us "
                        "(50 launches), between kernels 450.0 us, host 150.0 us")


def test_fold_layers_splits_a_replay_into_its_layers():
    """Two replays of a step: two input copies, three layers of (gemm, attn, gemm), a head.
    Spans are end minus the previous end (hand-computed: a 1 us gap before each attn)."""
    from ingot.bench.step_profile import fold_layers

    def replay(t0: float, attn_us: float) -> list[tuple[str, float, float]]:
        events, t = [("Memcpy", t0, t0 + 1.0), ("Memcpy", t0 + 1.0, t0 + 2.0)], t0 + 2.0
        for _ in range(3):
            for name, dur, gap in (("gemm", 5.0, 0.0), ("attn", attn_us, 1.0), ("gemm", 4.0, 0.0)):
                events.append((name, t + gap, t + gap + dur))
                t += gap + dur
        events.append(("lm_head", t, t + 50.0))
        return events

    layer = fold_layers([replay(0.0, 7.0), replay(1000.0, 9.0)], num_layers=3)
    assert [name for name, _, _ in layer] == ["gemm", "attn", "gemm"]
    assert [span for _, span, _ in layer] == [5.0, 9.0, 4.0]  # attn: median of 8.0 (x3) and 10.0 (x3)
    assert [own for _, _, own in layer] == [5.0, 8.0, 4.0]
    assert fold_layers([replay(0.0, 7.0)], num_layers=4) == []  # three layers do not fold into four
    mixed = replay(0.0, 7.0)
    mixed[5] = ("moe", *mixed[5][1:])  # the second layer's first kernel differs: no three equal layers
    assert fold_layers([mixed], num_layers=3) == []


def test_profile_lines_list_a_layer():
    from ingot.bench.step_profile import StepProfile

    bench = fabricated()
    bench.rows[0].profiles["graph"] = StepProfile([("GEMM", 113.0, 1200.0)], layer=[("_skinny_gemm_kernel", 9.5, 9.25),
                                                                                      ("_decode_kernel", 7.75, 7.5)])
    lines = decode_cli.profile_lines(bench)
    assert lines[2].startswith("  a layer, 17.2 us: each kernel from the end of the one before to its end")
    assert lines[3:] == ["       9.50 us (  9.25)  _skinny_gemm_kernel", "       7.75 us (  7.50)  _decode_kernel"]


def test_back_to_back_divides_one_run_of_queued_steps(monkeypatch):
    """On CPU: a clock that each call advances by 1.5 ms gives 1.5 ms per step, whatever the run length."""
    from ingot.bench import decode as decode_mod
    from ingot.runner import auto_compile

    clock = [0.0]

    def step():
        clock[0] += 1.5e-3

    monkeypatch.setattr(auto_compile.time, "perf_counter", lambda: clock[0])
    assert decode_mod.time_back_to_back(step, 4, torch.device("cpu")) == pytest.approx(1.5)
    assert decode_mod.time_back_to_back(step, 7, torch.device("cpu"), repeats=3) == pytest.approx(1.5)


def test_summarize_without_compiled():
    s = decode_cli.summarize(fabricated(("eager", "graph")))
    assert s[0]["compiled_speedup_vs_graph"] is None
    assert list(s[0]["modes"]) == ["eager", "graph"]


def test_table_text():
    text = report.table_text(decode_cli.make_table(fabricated()))
    for needle in ["ms/step", "back-to-back", "tokens/s", "% of floor", "eager", "graph", "compiled",
                   "16.500", "1.600", "1.875", "3,200", "4,000", "1.25x", "27.1", "0.013", "4,000 GB/s"]:
        assert needle in text, needle
    floor8 = decode_cli.floor_ms(MB, 8, 100, 4e12)
    assert f"{floor8:.3f}" in text
    assert f"{100 * floor8 / 2.0:.1f}" in text


def test_table_shows_the_sm_clock_when_sampled():
    bench = fabricated()
    assert "SM MHz" not in report.table_text(decode_cli.make_table(bench))
    bench.rows[1].gpu_state["compiled"] = {"sm_clock_mhz": 1755, "clock_limits": ["sw_power_cap"]}
    assert decode_cli.summarize(bench)[1]["modes"]["compiled"]["sm_clock_mhz"] == 1755
    assert decode_cli.summarize(bench)[1]["modes"]["graph"]["sm_clock_mhz"] is None
    text = report.table_text(decode_cli.make_table(bench))
    assert "SM MHz" in text and "1755" in text


def _numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


def test_json_round_trip(tmp_path):
    bench = fabricated()
    path = report.write_json(tmp_path / "sub" / "decode.json", decode_cli.to_json(bench))
    data = json.loads(path.read_text())
    assert data["context_len"] == 100 and data["iters"] == 30 and data["modes"] == ["eager", "graph", "compiled"]
    assert data["copy_bandwidth_bytes_per_s"] == 4e12
    assert data["model_bytes"] == {"weight_bytes": 1_000_000_000, "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "kv_elem_size": 2,
                                   "expert_bytes": 0, "moe_layers": 0, "num_experts": 0, "top_k": 0, "kv_parts": 2, "layer_windows": []}
    # every measured number comes back exactly
    for row, got in zip(bench.rows, data["timings"]):
        assert got == {"batch": row.batch, "ms": row.ms, "back_to_back_ms": row.back_to_back_ms,
                       "warmup_s": row.warmup_s, "capture_s": row.capture_s,
                       "auto_choice": row.auto_choice, "profiles": {}, "gpu_state": {}, "experts_hit": None,
                       "speculative": {}}
    # and every derived number
    assert data["summary"] == json.loads(json.dumps(decode_cli.summarize(bench)))
    written = set(_numbers(data))
    for s in decode_cli.summarize(bench):
        for v in _numbers(s):
            assert v in written


def test_write_json_makes_nan_null(tmp_path):
    path = report.write_json(tmp_path / "x.json", {"a": float("nan"), 1: (1.5, float("inf"))})
    assert json.loads(path.read_text()) == {"a": None, "1": [1.5, None]}


def test_plot_file(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "decode.png"
    decode_cli.plot(fabricated(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(report.ReportError, match="pip install matplotlib"):
        decode_cli.plot(fabricated(), str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------- the command without CUDA
def test_cpu_device_exits_2(capsys):
    assert main(["bench", "decode", "--device", "cpu", "--iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the benchmark")
def test_no_cuda_exits_2(capsys):
    assert main(["bench", "decode", "--shape", "qwen2.5-1.5b", "--batch-sizes", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_auto_compile_parses_and_still_needs_cuda(capsys):
    assert main(["bench", "decode", "--device", "cpu", "--decode-compile", "auto"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_plot_needs_matplotlib_before_timing(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "decode", "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


# ---------------------------------------------------------------------- the whole command, CUDA timing faked on CPU
def test_command_pipeline_with_cpu_timer(tmp_path, monkeypatch, capsys):
    """Everything but the CUDA events: a tiny checkpoint, the padded (fake) graph path, CPU wall-clock timing."""
    import statistics
    import time

    from ingot.bench import decode as decode_mod
    from tests.helpers import write_tiny_checkpoint

    def cpu_timer(fn, iters, device, warmup=3):
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    tiny = write_tiny_checkpoint(tmp_path / "llama", "llama")
    monkeypatch.setattr(decode_mod, "time_cuda", cpu_timer)
    monkeypatch.setattr(decode_cli, "_cuda_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(decode_cli, "measure_copy_bandwidth", lambda device: 1e11)
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--model", str(tiny), "--batch-sizes", "1,2", "--context-len", "16", "--iters", "2",
            "--dtype", "float32", "--json", str(out), "--quiet", "--gemm-floor"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "compiled" in printed and "batch 2: graph - GEMMs" in printed
    data = json.loads(out.read_text())
    assert data["source"] == str(tiny) and data["dtype"] == "float32" and data["tensor_parallel_size"] == 1
    assert data["modes"] == ["eager", "graph", "compiled", "gemm_only"]
    for row in data["summary"]:
        assert row["graph_minus_gemm_ms"] == pytest.approx(row["modes"]["graph"]["ms"] - row["modes"]["gemm_only"]["ms"])
    assert data["model_bytes"]["num_layers"] == 2 and data["model_bytes"]["kv_elem_size"] == 4
    # tiny llama: untied embed + lm_head 2*384*64, 2 layers of attention (64*64*2 + 64*32*2) and MLP (3*64*128), norms
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert data["model_bytes"]["weight_bytes"] == 4 * (2 * 384 * 64 + 2 * layer + 64)
    assert [r["batch"] for r in data["summary"]] == [1, 2]
    for row in data["summary"]:
        assert set(row["modes"]) == {"eager", "graph", "compiled", "gemm_only"} and all(m["ms"] > 0 for m in row["modes"].values())
        assert all(row["modes"][m]["back_to_back_ms"] > 0 for m in ("eager", "graph", "compiled"))
        assert row["modes"]["gemm_only"]["back_to_back_ms"] is None


def test_speculative_k_times_verify_steps_against_decode_steps(tmp_path, monkeypatch, capsys):
    """``--speculative-k 1,3``: per batch size and draft count, a verify step of batch x (k + 1) rows
    (the padded verify path on CPU: a bucket per row count) against the decode step, in a table
    and the JSON; the engine's pool and block tables hold the drafts."""
    from ingot.bench import decode as decode_mod
    from ingot.bench import decode_spec
    from tests.helpers import write_tiny_checkpoint

    timed = []

    def counting_timer(fn, iters, device, warmup=3):
        fn()
        timed.append(fn)
        return 1.0 + len(timed)  # each timing its own number: the ratios are checked by hand below

    tiny = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    monkeypatch.setattr(decode_mod, "time_cuda", counting_timer)
    monkeypatch.setattr(decode_mod, "time_back_to_back", lambda fn, steps, device: 1.0)
    monkeypatch.setattr(decode_cli, "_cuda_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(decode_cli, "measure_copy_bandwidth", lambda device: 1e11)
    rows_run = []
    real_run = decode_spec.DecodeGraphRunner.run
    monkeypatch.setattr(decode_spec.DecodeGraphRunner, "run",
                        lambda self, inputs: rows_run.append((self.store_first, inputs.num_seqs)) or real_run(self, inputs))
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--model", str(tiny), "--batch-sizes", "1,2", "--context-len", "30", "--iters", "1",
            "--decode-compile", "off", "--dtype", "float32", "--json", str(out), "--quiet", "--speculative-k", "1,3"]
    assert main(argv) == 0
    assert "verify step vs decode step" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["speculative_ks"] == [1, 3]
    spec = data["speculative"]
    assert [(s["mode"], s["batch"], s["k"], s["rows"]) for s in spec] == [
        ("graph", 1, 1, 2), ("graph", 1, 3, 4), ("graph", 2, 1, 4), ("graph", 2, 3, 8)]
    for s in spec:
        assert s["ratio"] == pytest.approx(s["verify_ms"] / s["decode_ms"])
        assert s["graph_ratio"] == pytest.approx(s["verify_graph_ms"] / s["decode_graph_ms"])
    assert {(True, 2), (True, 4), (True, 8)} <= set(rows_run) and (False, 2) in rows_run
    assert build_parser().parse_args(["bench", "decode"]).speculative_k is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "decode", "--speculative-k", "17"])


def test_command_pipeline_tensor_parallel_with_cpu_timer(tmp_path, monkeypatch, capsys):
    """``--tp 2`` on CPU: a worker process times the same steps in lockstep (gloo); the floor is one rank's shard."""
    from tests.helpers import write_tiny_checkpoint

    tiny = write_tiny_checkpoint(tmp_path / "llama", "llama")
    monkeypatch.setattr(decode_cli, "_cuda_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(decode_cli, "measure_copy_bandwidth", lambda device: 1e11)
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--model", str(tiny), "--batch-sizes", "1,2", "--context-len", "16", "--iters", "2",
            "--dtype", "float32", "--json", str(out), "--quiet", "--tp", "2"]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["tensor_parallel_size"] == 2 and data["source"].endswith("tensor parallel over 2")
    assert data["modes"] == ["eager", "graph", "compiled"]
    # one rank: half the heads, MLP features and (padded) vocabulary; norms whole
    layer = 64 * 32 * 2 + 64 * 16 * 2 + 3 * 64 * 64 + 2 * 64
    assert data["model_bytes"]["weight_bytes"] == 4 * (2 * 192 * 64 + 2 * layer + 64)
    assert data["model_bytes"]["num_kv_heads"] == 1
    assert main(argv + ["--gemm-floor"]) == 2
    assert "without --tp" in capsys.readouterr().err


def test_quantizations_side_by_side(tmp_path, monkeypatch, capsys):
    """``--quantization none,int8,int4``: one engine each, in order, and a table of them side by side;
    the JSON holds every run. (On CPU the quantized weights are dequantized at load, so the
    rows time the same dense model: the plumbing, not the speed.)"""
    from ingot.cli import build_parser
    from tests.helpers import write_tiny_checkpoint

    tiny = write_tiny_checkpoint(tmp_path / "llama", "llama", overrides=dict(hidden_size=128, intermediate_size=256))
    monkeypatch.setattr(decode_cli, "_cuda_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(decode_cli, "measure_copy_bandwidth", lambda device: 1e11)
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--model", str(tiny), "--batch-sizes", "1,2", "--context-len", "8", "--iters", "1",
            "--decode-compile", "off", "--dtype", "float32", "--json", str(out), "--quiet", "-q", "bf16,int8,int4"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "decode step by quantization" in printed and "int4" in printed
    doc = json.loads(out.read_text())
    assert [run["quantization"] for run in doc["runs"]] == ["none", "int8", "int4"]
    assert all([t["batch"] for t in run["timings"]] == [1, 2] for run in doc["runs"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "decode", "-q", "int3"])


def test_kv_bytes_window_aware_by_hand():
    """Sliding layers read at most their window of the context; global layers all of it."""
    mb = ModelBytes(weight_bytes=0, num_layers=4, num_kv_heads=2, head_dim=64, kv_elem_size=2,
                    layer_windows=(100, 0, 100, 0))
    per_token = 2 * 2 * 64 * 2  # K and V, 2 heads, 64 dims, 2 bytes
    assert mb.kv_bytes(3, 1000) == 3 * (100 + 1000 + 100 + 1000) * per_token
    assert mb.kv_bytes(3, 50) == 3 * 4 * 50 * per_token  # shorter than every window
