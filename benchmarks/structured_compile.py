"""Time structured-output grammar compilation as the engine runs it (host only, no GPU).

    python -m benchmarks.structured_compile [--schema FILE] [--rounds N] [--model M] [--out PATH]

For a JSON schema (default: benchmarks/schemas/order-20-properties.json) against a model's
vocabulary (default: the default model's tokenizer): the check a request gets in the
caller's thread (``structured.check``: the grammar built without the vocabulary); a cold
compilation (``Grammars`` compiling a schema it has not seen: each round renames one
property so that nothing is reused); and a cached request (the same constraint again: the
future of the first compilation comes back). Medians over ``--rounds``; prints a table and
writes JSON (default benchmarks/results/structured-compile-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from importlib.metadata import version
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_SCHEMA = Path(__file__).resolve().parent / "schemas" / "order-20-properties.json"


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schema", type=Path, default=DEFAULT_SCHEMA)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--model", default="default", help="whose tokenizer (default: the default model's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from ingot.engine.structured import Grammars, check, xgrammar
    from ingot.loading.checkpoint import open_tokenizer
    from ingot.sampling_params import StructuredOutputsParams

    tokenizer = open_tokenizer(args.model)
    grammars = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    schema = json.loads(args.schema.read_text())
    xgrammar()  # the one-time import is not a compilation
    grammars._compile(StructuredOutputsParams(json={"type": "object"}).key).result()  # builds the compiler

    def variant(i: int) -> StructuredOutputsParams:
        props = dict(schema["properties"])
        first = next(iter(props))
        props[f"{first}_{i}"] = props.pop(first)
        required = [f"{first}_{i}" if r == first else r for r in schema.get("required", [])]
        return StructuredOutputsParams(json={**schema, "properties": props, "required": required})

    specs = [variant(i) for i in range(args.rounds)]
    checks = [_ms(lambda s=s: check(s)) for s in specs]
    colds = [_ms(lambda s=s: grammars._compile(s.key).result()) for s in specs]
    cached = [_ms(lambda s=s: grammars._compile(s.key).result()) for s in specs]
    rows = dict(check_ms=statistics.median(checks), cold_compile_ms=statistics.median(colds),
                cold_compile_max_ms=max(colds), cached_ms=statistics.median(cached))
    print(f"# schema {args.schema.name} ({len(schema['properties'])} properties), vocabulary {tokenizer.vocab_size}, "
          f"xgrammar {version('xgrammar')}, {args.rounds} rounds")
    print(f"{'step':<28} {'median ms':>10}")
    print(f"{'check (caller thread)':<28} {rows['check_ms']:10.3f}")
    print(f"{'compile, not seen before':<28} {rows['cold_compile_ms']:10.3f}   (max {rows['cold_compile_max_ms']:.3f})")
    print(f"{'compile, cached':<28} {rows['cached_ms']:10.3f}")
    out = args.out or RESULTS / f"structured-compile-{dt.date.today().isoformat()}.json"
    out.write_text(json.dumps(dict(
        command="python -m benchmarks.structured_compile", schema=args.schema.name, model=args.model,
        vocab_size=tokenizer.vocab_size, rounds=args.rounds, xgrammar=version('xgrammar'),
        machine=dict(python=platform.python_version(), processor=platform.processor() or platform.machine()),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **rows,
        every_round=dict(check_ms=checks, cold_compile_ms=colds, cached_ms=cached)), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
