"""Placeholder: the command is being written."""

from __future__ import annotations


def add_parser(subparsers, engine_args) -> None:
    return None
