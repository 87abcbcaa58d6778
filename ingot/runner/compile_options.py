"""The pure pieces of the decode compile: Inductor options and Dynamo limit names,
resolved against the installed PyTorch's config objects (tested against fakes shaped
like each version).

PyTorch versions (>= 2.8, the declared floor). Option names move between releases,
so every name is looked up on the installed config before use and absent ones are
dropped (Inductor rejects unknown options):

* division rounding: ``emulate_divison_rounding`` (2.10, sic) became
  ``eager_numerics.division_rounding`` (2.11+); neither exists in 2.8/2.9;
* programmatic dependent launch of Inductor's kernels: ``triton.enable_pdl`` (2.11+;
  Inductor applies it on sm_90+ only).
"""

from __future__ import annotations

from typing import Any

# Modules Dynamo must never trace into (kernel launchers, attention wrappers).
SKIP_MODULES = ("triton", "flash_attn", "flash_attn_interface")

# Division rounding like eager: the newest name first (only one is returned).
_DIVISION_ROUNDING = ("eager_numerics.division_rounding", "emulate_divison_rounding")
DYNAMO_LIMITS = ("recompile_limit", "accumulated_recompile_limit")


def has_option(config: Any, name: str) -> bool:
    """Whether ``config`` has the (possibly dotted) option ``name``.

    Walks nested attributes: ``"triton.cudagraphs"`` is ``config.triton.cudagraphs``,
    which is how the real config modules expose sub-configs.
    """
    obj = config
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return False
    return True


def inductor_options(inductor_config: Any) -> dict[str, Any]:
    """The Inductor ``options=`` for the decode compile, limited to names ``inductor_config`` has.

    Inductor's own cudagraphs off (we capture), eager-like precision casts and
    division rounding where the version has them, and programmatic dependent launch
    (``triton.enable_pdl``): each Inductor kernel then waits for its predecessor
    before reading what it wrote and releases its successor after that read, so the
    compiled MoE routing joins the PDL chain of ingot's decode kernels
    (``ingot/ops/triton/pdl.py``).
    """
    opts: dict[str, Any] = {}
    if has_option(inductor_config, "triton.cudagraphs"):
        opts["triton.cudagraphs"] = False
    if has_option(inductor_config, "emulate_precision_casts"):
        opts["emulate_precision_casts"] = True
    if has_option(inductor_config, "triton.enable_pdl"):
        opts["triton.enable_pdl"] = True
    for name in _DIVISION_ROUNDING:
        if has_option(inductor_config, name):
            opts[name] = True
            break
    return opts


def dynamo_limit_names(dynamo_config: Any) -> tuple[str, ...]:
    """Names of the per-code and accumulated recompile limits ``dynamo_config`` has."""
    return tuple(n for n in DYNAMO_LIMITS if has_option(dynamo_config, n))
