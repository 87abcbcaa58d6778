"""Registers the `ingot bench ...` and `ingot check ...` subcommands.

Each command lives in its own module with ``add_parser(subparsers, engine_args)``
that sets ``func`` on its parser; this file only lists them.
"""

from __future__ import annotations

import argparse
from typing import Callable

EngineArgs = Callable[[argparse.ArgumentParser], None]


def add_parsers(bench_sub, check_sub, engine_args: EngineArgs) -> None:
    return None
