"""Count the sm_90 instructions the quantized GEMV / GEMM kernels spend per weight in their K loop.

    python -m benchmarks.quant_sass [--out PATH] [--shapes 7b] [--batches 1,16,64,256]
                                    [--formats int4-g128,...] [--arch 90] [--dump DIR]
                                    [--set block_n=128,num_warps=8,...]

No GPU needed: each (format, batch, projection) goes through its op (``int_linear`` /
``fp8_linear``) with the op's own ``launch_config`` as an sm_90 GPU would choose it (fp8
hardware conversions, PDL, 132 SMs), on CPU tensors of the real shapes; a stand-in Triton
driver makes the launch compile the kernel for ``--arch`` and stop there. The compiled
cubin is disassembled (the ``cuobjdump`` shipped with Triton) and its K loop found: the
largest range closed by a backward branch. Reported per kernel (duplicates folded):

* ``instr/w``: the loop's instructions x threads per program / weights per iteration
  (BLOCK_N x BLOCK_K), i.e. thread-instructions per weight. At batch 1 an H200 issues
  about 4 x 132 x 1.98e9 warp-instructions a second against ~8e12 int4 weights a second
  at copy bandwidth: about 3.5-4 a weight (fp8: 7-8) keep up with HBM;
* the loop's length, registers, spills, and its most frequent opcodes.

Prints a table and writes JSON (default benchmarks/results/quant-sass-<date>.json).
``--dump DIR`` also writes each kernel's SASS there; ``--set`` overrides launch fields of
every table entry (a sweep without a GPU: registers, spills and instructions per weight).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import re
import subprocess
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import torch

from benchmarks.quant_kernels import BF16, RESULTS, SHAPES
from ingot.bench.report import write_json

# name -> ("int", bits, group (0: per channel), zeros, mins) or ("fp8", block_n, block_k, act_group)
FORMATS = {
    "int4-g128": ("int", 4, 128, True, False),
    "int4-g128-sym": ("int", 4, 128, False, False),  # online int4 (-q int4), GPTQ symmetric: zero point 8
    "int4-g32-mins": ("int", 4, 32, False, True),
    "int8-g128": ("int", 8, 128, False, False),
    "int8-channel": ("int", 8, 0, False, False),
    "fp8-block-w8a16": ("fp8", 128, 128, -1),
    "fp8-block-w8a8": ("fp8", 128, 128, 128),
    "fp8-channel-w8a8": ("fp8", 1, 0, 0),
}
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


class _Compiled(Exception):
    """Raised in place of a launch: the kernel compiled for the target, and its launch options."""

    def __init__(self, kernel, fn, options, constexprs):
        super().__init__(fn.__name__)
        self.kernel, self.fn, self.options = kernel, fn, options
        self.constants = {fn.arg_names[path[0]]: value for path, value in constexprs.items()}


def pretend_sm90(arch: int) -> None:
    """Triton compiles for ``arch`` with no device (a stand-in driver; launches raise ``_Compiled``), and the
    ops' launch tables answer as on an sm_90 GPU with 132 SMs."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import jit
    from triton.runtime.driver import driver

    from ingot.ops.triton import _common, fp8_linear, pdl

    target = GPUTarget("cuda", arch, 32)

    class StandInDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return target

    driver.set_active(StandInDriver())
    compile_only = jit.JITFunction._do_compile

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = compile_only(self, key, signature, device, constexprs, options, attrs, warmup)
        self.device_caches[device][0].pop(key, None)  # a later call compiles (from the on-disk cache) and stops again
        raise _Compiled(kernel, self, options, constexprs)

    jit.JITFunction._do_compile = do_compile
    for module in (pdl, fp8_linear):
        module.capability = lambda device: (arch // 10, arch % 10)
    _common.num_sms = lambda device: 132


def _int_args(n: int, k: int, m: int, bits: int, group: int, zeros: bool, mins: bool) -> list:
    g = -(-k // group)
    qweight = torch.empty(n, k * bits // 32, dtype=torch.int32)
    scales = torch.empty(n, g, dtype=torch.float16)
    zero_pts = torch.empty(n, g, dtype=torch.uint8) if zeros else None
    min_vals = torch.empty(n, g, dtype=torch.float16) if mins else None
    return [torch.empty(m, k, dtype=BF16), qweight, scales, zero_pts, min_vals, None, bits, group,
            0 if mins else 2 ** (bits - 1)]


def compile_case(fmt: str, n: int, k: int, m: int, fields: Optional[dict] = None):
    """(the op's launch config with ``fields`` replaced, ``_Compiled`` of its main kernel, or None where
    no Triton kernel serves it)."""
    from ingot.ops.triton import fp8_linear, int_linear

    spec = FORMATS[fmt]
    cpu = torch.device("cpu")
    if spec[0] == "int":
        _, bits, group, zeros, mins = spec
        group = group or k
        cfg = replace(int_linear.launch_config(m, n, k, group, cpu, bits=bits), **(fields or {}))
        call = lambda: int_linear.int_linear(*_int_args(n, k, m, bits, group, zeros, mins), config=cfg)  # noqa: E731
    else:
        _, block_n, block_k, act_group = spec
        cfg = replace(fp8_linear.launch_config(m, n, k, block_n, block_k, act_group, cpu), **(fields or {}))
        if cfg.scaled_mm and not cfg.gemv:
            return cfg, None
        gn, gk = -(-n // (block_n or n)), -(-k // (block_k or k))
        args = [torch.empty(m, k, dtype=BF16), torch.empty(n, k, dtype=torch.float8_e4m3fn),
                torch.empty(gn, gk, dtype=torch.float32), None, block_n, block_k, act_group]
        fp8_linear.act_quant = lambda x, group: (torch.empty(x.shape, dtype=torch.float8_e4m3fn),
                                                  torch.empty(x.shape[0], x.shape[1] // (group or x.shape[1])))
        call = lambda: fp8_linear.fp8_linear(*args, config=cfg)  # noqa: E731
    try:
        call()
    except _Compiled as compiled:
        return cfg, compiled
    raise RuntimeError(f"{fmt} M={m}: no kernel was launched")


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """Triton's cuobjdump run on a cubin."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, *flags, f.name], check=True, capture_output=True,
                              text=True).stdout


def sass_of(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of a cubin's code."""
    return [(int(a, 16), ins) for a, ins in _SASS_LINE.findall(cuobjdump(cubin, "-sass"))]


def resources(cubin: bytes) -> dict:
    """Registers and local memory (spills) a thread uses."""
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", cuobjdump(cubin, "-res-usage")))
    return dict(registers=int(usage.get("REG", 0)), local_bytes=int(usage.get("LOCAL", 0)) + int(usage.get("STACK", 0)))


def k_loop(sass: list[tuple[int, str]]) -> list[str]:
    """The instructions of the largest range closed by a backward branch (the K loop)."""
    best: list[str] = []
    for i, (addr, ins) in enumerate(sass):
        hit = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if hit and int(hit.group(1), 16) < addr:
            body = [s for a, s in sass[: i + 1] if a >= int(hit.group(1), 16)]
            best = body if len(body) > len(best) else best
    return best


def opcode(ins: str) -> str:
    """``@P0 FFMA.FTZ R1, ...`` -> ``FFMA``."""
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]


def measure(compiled: "_Compiled") -> dict:
    kernel, opts, const = compiled.kernel, compiled.options, compiled.constants
    block_n, block_k = const["BLOCK_N"], const["BLOCK_K"]
    loop = k_loop(sass_of(kernel.asm["cubin"]))
    res = resources(kernel.asm["cubin"])
    threads = opts.num_warps * 32
    ops = collections.Counter(opcode(s) for s in loop)
    meta = kernel.metadata
    return dict(kernel=compiled.fn.__name__, loop_len=len(loop), instr_per_weight=len(loop) * threads / (block_n * block_k),
                **res, shared=meta.shared, top_ops=dict(ops.most_common(8)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/quant-sass-<date>.json)")
    parser.add_argument("--shapes", default="7b", help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--batches", default="1,16,64,256", help="comma-separated row counts")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of: " + ", ".join(FORMATS))
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: sm_90)")
    parser.add_argument("--dump", type=Path, default=None, help="also write each kernel's SASS into this folder")
    parser.add_argument("--set", default="", help="launch fields to override, e.g. block_n=128,num_warps=8 "
                        "(QuantLaunch's names; ints and True/False)")
    args = parser.parse_args()
    formats, batches = args.formats.split(","), [int(b) for b in args.batches.split(",")]
    unknown = [f for f in formats if f not in FORMATS] + [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown formats or shapes: {unknown}")
    fields = {key: (value == "True") if value in ("True", "False") else int(value)
              for key, value in (item.split("=") for item in args.set.split(",") if item)}
    pretend_sm90(args.arch)

    import triton

    rows, seen = [], {}
    print(f"# sm_{args.arch} | triton {triton.__version__} | K loop instructions per weight (thread-instructions)")
    print(f"{'format':<17} {'M':>4} {'proj':<8} {'kernel':<13} {'tile (m x n x k, warps, stages)':<31} "
          f"{'loop':>5} {'instr/w':>8} {'regs':>5} {'spill':>5}  top opcodes")
    for shape in args.shapes.split(","):
        for fmt in formats:
            for m in batches:
                for proj, (n, k) in SHAPES[shape].items():
                    cfg, compiled = compile_case(fmt, n, k, m, fields)
                    if compiled is None:
                        row = dict(kernel="torch._scaled_mm")
                    else:
                        const = compiled.constants
                        key = compiled.kernel.hash
                        if key not in seen:
                            seen[key] = measure(compiled)
                            if args.dump:
                                args.dump.mkdir(parents=True, exist_ok=True)
                                (args.dump / f"{fmt}-m{m}-{proj}.sass").write_text(
                                    cuobjdump(compiled.kernel.asm["cubin"], "-sass"))
                        row = dict(seen[key], tile=f"{const['BLOCK_M']}x{const['BLOCK_N']}x{const['BLOCK_K']} "
                                                  f"w{cfg.num_warps} s{cfg.num_stages}")
                    row.update(format=fmt, m=m, shape=shape, proj=proj, n=n, k=k, config=asdict(cfg))
                    rows.append(row)
                    if compiled is None:
                        print(f"{fmt:<17} {m:>4} {proj:<8} torch._scaled_mm")
                        continue
                    tops = " ".join(f"{o}:{c}" for o, c in row["top_ops"].items())
                    print(f"{fmt:<17} {m:>4} {proj:<8} {row['kernel'][1:]:<13} {row['tile']:<31} {row['loop_len']:>5} "
                          f"{row['instr_per_weight']:8.2f} {row['registers']:>5} {row['local_bytes']:>5}  {tops}")
    result = dict(arch=args.arch, triton=triton.__version__, date=dt.datetime.now().isoformat(timespec="seconds"),
                  rows=rows)
    out = write_json(args.out or RESULTS / f"quant-sass-{dt.date.today().isoformat()}.json", result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
