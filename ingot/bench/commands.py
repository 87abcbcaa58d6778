"""Registers the `ingot bench ...` and `ingot check ...` subcommands.

Each command lives in its own module with ``add_parser(subparsers, engine_args)``
that adds its parser and sets ``func`` (called with the parsed args; returns the
exit code); this file only lists them.
"""

from __future__ import annotations

import argparse
from typing import Callable

from ingot.bench import decode_cli, drift_cli, serve_cli

EngineArgs = Callable[[argparse.ArgumentParser], None]


def add_parsers(bench_sub, check_sub, engine_args: EngineArgs) -> None:
    decode_cli.add_parser(bench_sub, engine_args)  # ingot bench decode
    serve_cli.add_parser(bench_sub, engine_args)  # ingot bench serve
    drift_cli.add_parser(check_sub, engine_args)  # ingot check drift
