"""Speculative decoding in the benchmarks and checks: the option, plain decoding on the same
engine, and the speed-up measured in one run.

Plain decoding for a comparison is the speculative engine itself with its speculator
detached (``speculation_off``; a draft model idle): the same model, KV pool, decode graphs and
settings, so the two runs differ only in whether sequences propose drafts, and they can alternate round by
round in one process (``ingot bench serve --compare-speculative``, ``ingot check drift
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
from ingot.runner.draft_runner import DraftedModelRunner


def speculative_arg(text: str) -> SpeculativeConfig:
    """``--speculative-config``'s JSON, validated while the options are parsed (before a model
    loads): argparse reports what is wrong with it as the option's error."""
    try:
        return SpeculativeConfig.from_dict(speculative_config_arg(text))
    except ConfigError as exc:  # (argparse names the option itself)
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--speculative-config: ")) from None


def describe(config: Optional[SpeculativeConfig]) -> str:
    """``ngram k=4 (lookup 2-5)``, ``draft k=4 (NAME)``; ``plain`` without speculation."""
    if config is None:
        return "plain"
    if config.uses_draft_model:
        return f"draft k={config.num_speculative_tokens} ({Path(str(config.model)).name})"
    return f"{config.method} k={config.num_speculative_tokens} (lookup {config.prompt_lookup_min}-{config.prompt_lookup_max})"


def as_json(config: Optional[SpeculativeConfig]) -> Optional[dict[str, Any]]:
    return None if config is None else dataclasses.asdict(config)


@contextlib.contextmanager
def speculation_off(engine: Any) -> Iterator[None]:
    """Inside, ``engine`` decodes plainly: no sequence proposes drafts, so no step verifies
    any (its ``Speculator`` detached), and a draft model sits out every step; everything else
    about the engine stays. Only on an idle engine: a sequence holding drafts must be read
    back by the speculator. With a draft model the prefix cache is emptied on the way out:
    blocks computed inside hold no draft K/V."""
    if engine.has_unfinished():
        raise RuntimeError("speculation is switched only on an idle engine")
    spec, engine.spec = engine.spec, None
    engine.executor.run_on_ranks(set_draft_following, False)
    try:
        yield
    finally:
        engine.spec = spec
        if engine.executor.run_on_ranks(set_draft_following, True):
            engine.reset_prefix_cache()


def set_draft_following(runner: Any, on: bool) -> bool:
    """Let a draft model follow the target's steps, or not (``DraftedModelRunner.draft_follows``);
    whether ``runner`` has one."""
    if isinstance(runner, DraftedModelRunner):
        runner.draft_follows = on
        return True
    return False


def speedup(plain: Sequence[float], speculative: Sequence[float]) -> dict[str, Any]:
    """Speculative / plain output tokens/s of each round (paired runs of one round) and their
    median: the speed-up as measured in one run."""
    if len(plain) != len(speculative) or not plain:
        raise ValueError("a speed-up needs as many speculative as plain rounds, at least one")
    ratios = [s / p for p, s in zip(plain, speculative)]
    return {"median": statistics.median(ratios), "rounds": ratios}
