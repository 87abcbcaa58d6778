"""Speculative decoding in the benchmarks and checks: the option, plain decoding on the same
engine, and the speed-up measured in one run.

Plain decoding for a comparison is the speculative engine itself with its speculator
detached (``speculation_off``; a draft model idle: the engine never asks it to run): the same
model, KV pool, decode graphs and settings, so the two runs differ only in whether sequences
propose drafts, and they can alternate round by round in one process (``ingot bench serve --compare-speculative``, ``ingot check drift
--speculative-config``) instead of comparing two engines built at different times.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from ingot.config import ConfigError, SpeculativeConfig
from ingot.engine_args import speculative_config_arg


def speculative_arg(text: str) -> SpeculativeConfig:
    """``--speculative-config``'s JSON, validated while the options are parsed (before a model
    loads): argparse reports what is wrong with it as the option's error."""
    try:
        return SpeculativeConfig.from_dict(speculative_config_arg(text))
    except ConfigError as exc:  # (argparse names the option itself)
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--speculative-config: ")) from None


def describe(config: Optional[SpeculativeConfig]) -> str:
    """``ngram k=4 (lookup 2-5)``, ``draft k=4 (NAME)``, ``eagle3 k=4 (NAME)``; ``plain`` without speculation."""
    if config is None:
        return "plain"
    if config.uses_eagle:
        return f"{config.method} k={config.num_speculative_tokens} ({Path(str(config.model)).name})"
    if config.uses_draft_model:
        return f"draft k={config.num_speculative_tokens} ({Path(str(config.model)).name})"
    return f"{config.method} k={config.num_speculative_tokens} (lookup {config.prompt_lookup_min}-{config.prompt_lookup_max})"


def as_json(config: Optional[SpeculativeConfig]) -> Optional[dict[str, Any]]:
    return None if config is None else dataclasses.asdict(config)


@contextlib.contextmanager
def speculation_off(engine: Any) -> Iterator[None]:
    """Inside, ``engine`` decodes plainly: no sequence proposes drafts, so no step verifies
    any, and a draft model sits out every step (the engine's ``Speculator``, which asks for
    both, detached); everything else about the engine stays. Only on an idle engine: a
    sequence holding drafts must be read back by the speculator. Blocks cached inside hold
    no draft K/V, as the block manager knows: a later hit on them catches the draft up."""
    if engine.has_unfinished():
        raise RuntimeError("speculation is switched only on an idle engine")
    spec, engine.spec = engine.spec, None
    try:
        yield
    finally:
        engine.spec = spec


def speedup(plain: Sequence[float], speculative: Sequence[float]) -> dict[str, Any]:
    """Speculative / plain output tokens/s of each round (paired runs of one round) and their
    median: the speed-up as measured in one run."""
    if len(plain) != len(speculative) or not plain:
        raise ValueError("a speed-up needs as many speculative as plain rounds, at least one")
    ratios = [s / p for p, s in zip(plain, speculative)]
    return {"median": statistics.median(ratios), "rounds": ratios}
