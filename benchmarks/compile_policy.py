"""Which fusible ops should run their PyTorch form under compile? Measure both policies.

For each policy (all of rms_norm/rotary/silu_and_mul native, or none: every
op an opaque kernel), on the GPU:
  * drift of compiled graph vs graph on SmolLM2-135M bf16 (teacher-forced and
    free-running greedy, 8 prompts x --steps, buckets 1 and 8);
  * ms per decode step of the compiled graph on the Qwen2.5-1.5B shape.
Prints a table and writes JSON.

    python benchmarks/compile_policy.py --steps 128 --out results/compile_policy.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingot import LLM  # noqa: E402
from ingot.bench.decode import bench_decode, build_shape  # noqa: E402
from ingot.bench.report import env_info, write_json  # noqa: E402
from ingot.bench.drift import DecodeModes, as_dicts, free_running, teacher_forced  # noqa: E402
from ingot.config import FUSIBLE_OPS, EngineConfig  # noqa: E402

PROMPTS_CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain recursion."}],
]
PROMPTS_PLAIN = ["The history of the Roman Empire", "def fibonacci(n):", "Once upon a time, in a small village,",
                 "The three laws of thermodynamics are", "import torch\nimport numpy as np\n\n"]
POLICIES = {"native": FUSIBLE_OPS, "opaque": ()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--policies", default="native,opaque")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = {"env": env_info(), "steps": args.steps, "policies": {}}
    for name in args.policies.split(","):
        ops = POLICIES[name]
        llm = LLM(None, dtype="bfloat16", device="cuda", max_num_seqs=8, cudagraph_capture_sizes=(1, 8),
                  show_progress=False, max_model_len=1024, gpu_memory_utilization=0.2, compile_native_ops=ops)
        tok = llm.get_tokenizer()
        prompts = [tok.encode_chat(c) for c in PROMPTS_CHAT] + [tok.encode(p) for p in PROMPTS_PLAIN]
        entry = {"ops": list(ops), "drift": {}}
        for bucket in (1, 8):
            modes = DecodeModes(llm.engine, bucket)
            tf = teacher_forced(modes, prompts, args.steps)
            fr = free_running(modes, prompts, args.steps)
            entry["drift"][bucket] = {"teacher_forced": as_dicts(tf), "free_running": as_dicts(fr)}
            for r in tf:
                print(f"{name:>7} bucket {bucket}: {r.mode:>8} vs graph  top1 {r.top1_agreement:.4f}  max rel err {r.max_rel_logit_err:.2e}"
                      f"  mean {r.mean_rel_logit_err:.2e}  bitwise {r.bitwise_equal}", flush=True)
            for r in fr:
                print(f"{name:>7} bucket {bucket}: {r.mode:>8} free-running identical {r.identical}/{r.total} first divergence {r.first_divergence}", flush=True)
            del modes
        del llm
        torch.cuda.empty_cache()
        if not args.skip_speed:
            model, cfg = build_shape("qwen2.5-1.5b", torch.bfloat16, torch.device("cuda"), 1024)
            batches = [int(b) for b in args.batches.split(",")]
            rows = bench_decode(model, cfg, batches, 512, ["graph", "compiled"], config=EngineConfig(compile_native_ops=ops))
            entry["speed_qwen2.5-1.5b"] = [r.__dict__ for r in rows]
            for r in rows:
                print(f"{name:>7} 1.5B batch {r.batch}: graph {r.ms['graph']:.3f} ms, compiled {r.ms['compiled']:.3f} ms ({r.ms['graph'] / r.ms['compiled']:.2f}x)", flush=True)
            del model
            torch.cuda.empty_cache()
        report["policies"][name] = entry
    out = write_json(args.out or Path(__file__).parent / "results" / f"compile_policy-{dt.date.today()}.json", report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
