"""Find who hangs Inductor while it lowers a decode step (the batch-1 skinny path hang).

The fifth session saw ``torch.compile`` of a batch-1 decode step built from the
skinny GEMV ops recurse for minutes in ``ExternKernel.__str__`` (PyTorch 2.11,
CUDA); faulthandler shows only the innermost 100 frames, all in that recursion.
This script compiles a step with the skinny ops (the default run: one
``decode_graphs.py`` bucket) and after ``--after`` seconds prints the
*outermost* frames of the main thread, i.e. the caller, then exits.

Sixth session: it found ``GraphLowering.call_function`` formatting its
implicit-fallback log message eagerly; ``--short-errors`` elides that
formatting (the step then compiled in 6 s), and ``runner/inductor_fallbacks.py``
is the fix; ``--no-fallbacks`` turns the fix off, to reproduce the hang on
PyTorch <= 2.11 (with ``--norm-prologue-max-n 1000000000`` at the 1.5B shape,
or any SmolLM2 run).

    python3 benchmarks/compile_hang_probe.py --after 60 --shape qwen2.5-1.5b
    python3 benchmarks/compile_hang_probe.py --after 180 -- -m ingot check drift --buckets 1
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _dump_and_exit(outer: int, inner: int) -> None:
    frames = traceback.extract_stack(sys._current_frames()[__import__("threading").main_thread().ident])
    print(f"\n# main thread: {len(frames)} frames; outermost {outer}:", flush=True)
    for f in frames[:outer]:
        print(f"  {f.filename}:{f.lineno} {f.name}", flush=True)
    print(f"# innermost {inner}:", flush=True)
    for f in frames[-inner:]:
        print(f"  {f.filename}:{f.lineno} {f.name}", flush=True)
    os._exit(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after", type=int, default=60, help="seconds before the stack dump")
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="shape for the default run (decode_graphs.py, batch 1)")
    ap.add_argument("--norm-prologue-max-n", type=int, default=None,
                    help="layers.linear.NORM_PROLOGUE_MAX_N for this run (the fifth session hung with it unbounded)")
    ap.add_argument("--no-fallbacks", action="store_true",
                    help="skip runner/inductor_fallbacks.py (the fix), to reproduce the hang")
    ap.add_argument("--short-errors", action="store_true",
                    help="let Inductor's LoweringException name its op without printing the IR arguments "
                         "(that printing is the hang), so the real lowering error shows")
    ap.add_argument("--outer", type=int, default=70)
    ap.add_argument("--inner", type=int, default=12)
    ap.add_argument("cmd", nargs=argparse.REMAINDER,
                    help="after --: '-m module args' or 'script.py args' to run instead of the default")
    args = ap.parse_args()

    import ingot.layers.linear as linear
    from ingot.runner import inductor_fallbacks

    if args.no_fallbacks:
        inductor_fallbacks.register_op_fallbacks = lambda *a, **k: False
    if args.norm_prologue_max_n is not None:
        linear.NORM_PROLOGUE_MAX_N = args.norm_prologue_max_n
    if args.short_errors:
        import torch._inductor.exc as inductor_exc

        inductor_exc.OperatorIssue.operator_str = staticmethod(lambda target, a, kw: f"{target} (IR arguments not printed)")
    signal.signal(signal.SIGALRM, lambda *_: _dump_and_exit(args.outer, args.inner))
    signal.alarm(args.after)

    import runpy

    cmd = [c for c in args.cmd if c != "--"]
    if not cmd:
        cmd = [str(Path(__file__).parent / "decode_graphs.py"), "--shapes", args.shape, "--batches", "1",
               "--modes", "graph,compiled", "--skinny-rows", "1", "--iters", "10",
               "--out", os.path.join(os.environ.get("OUT", "/tmp"), f"probe-{args.shape}.json")]
    if cmd[0] == "-m":
        sys.argv = cmd[1:]
        runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = cmd
        runpy.run_path(cmd[0], run_name="__main__")
    print(f"{' '.join(cmd)}: finished, no hang", flush=True)


if __name__ == "__main__":
    main()
