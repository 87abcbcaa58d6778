"""Find who hangs Inductor on the skinny batch-1 decode step (torch 2.11, CUDA).

The fifth session saw ``torch.compile`` of a batch-1 decode step built from the
skinny GEMV ops recurse for minutes in ``ExternKernel.__str__``; faulthandler
only shows the innermost 100 frames, all in that recursion. This script lifts
the compile bypass in ``layers/linear.py``, compiles one bucket, and after
``--after`` seconds prints the *outermost* frames of the main thread (the
caller), then exits.

    python3 benchmarks/compile_hang_probe.py --after 60 --shape qwen2.5-1.5b
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
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--outer", type=int, default=70)
    ap.add_argument("--inner", type=int, default=12)
    args = ap.parse_args()

    import ingot.layers.linear as linear

    linear.is_compiling = lambda: False  # lift the bypass: compile the skinny ops
    signal.signal(signal.SIGALRM, lambda *_: _dump_and_exit(args.outer, args.inner))
    signal.alarm(args.after)

    import runpy

    sys.argv = ["decode_graphs.py", "--shapes", args.shape, "--batches", "1", "--modes", "compiled",
                "--skinny-rows", "1", "--iters", "5", "--out", os.path.join(os.environ.get("OUT", "/tmp"), "probe.json")]
    runpy.run_path(str(Path(__file__).parent / "decode_graphs.py"), run_name="__main__")
    print("compiled bucket 1 with the skinny ops: no hang", flush=True)


if __name__ == "__main__":
    main()
