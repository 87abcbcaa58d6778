"""Registers the `ingot bench ...` and `ingot check ...` subcommands.

Each command lives in its own module with ``add_parser(subparsers)``
that adds its parser and sets ``func`` (called with the parsed args; returns the
exit code); this file only lists them.
"""

from __future__ import annotations

from ingot.bench import decode_cli, drift_cli, quant_check, serve_cli


def add_parsers(bench_sub, check_sub) -> None:
    decode_cli.add_parser(bench_sub)  # ingot bench decode
    serve_cli.add_parser(bench_sub)  # ingot bench serve
    drift_cli.add_parser(check_sub)  # ingot check drift
    quant_check.add_parser(check_sub)  # ingot check quant
