"""The pure pieces of the decode compile: Inductor options, Dynamo limit names and skip
rules, resolved against the installed PyTorch's config objects (tested against fakes
shaped like each version).

PyTorch versions (>= 2.8 supported). Option names move between releases, so
every name is looked up on the installed config before use and absent ones
are dropped (Inductor rejects unknown options):

* division rounding: ``emulate_divison_rounding`` (2.10, sic) became
  ``eager_numerics.division_rounding`` (2.11+); neither exists in 2.8/2.9;
* strict numerics: ``fallback_random`` (all), ``deterministic`` (2.10+),
  ``eager_numerics.disable_ftz`` (newer; present in 2.13);
* Dynamo limits: ``recompile_limit``/``accumulated_recompile_limit`` (2.7+;
  the old ``cache_size_limit`` names are aliases) else the old names;
* programmatic dependent launch of Inductor's kernels: ``triton.enable_pdl`` (2.11+;
  Inductor applies it on sm_90+ only).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from ingot.config import EngineConfig

MIN_TORCH = (2, 8)
# Modules Dynamo must never trace into (kernel launchers, attention wrappers).
DEFAULT_SKIP_MODULES = ("triton", "flash_attn", "flash_attn_interface")

# Division rounding like eager: the newest name first (only one is returned).
_DIVISION_ROUNDING = ("eager_numerics.division_rounding", "emulate_divison_rounding")
_STRICT_OPTIONS = ("fallback_random", "eager_numerics.disable_ftz", "deterministic")
_NEW_LIMITS = ("recompile_limit", "accumulated_recompile_limit")
_OLD_LIMITS = ("cache_size_limit", "accumulated_cache_size_limit")


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


def inductor_options(inductor_config: Any, strict: bool = False, autotune_gemm: bool = False) -> dict[str, Any]:
    """The Inductor ``options=`` for the decode compile, limited to names ``inductor_config`` has.

    Always: Inductor's own cudagraphs off (we capture), eager-like precision
    casts and division rounding where the version has them, and programmatic dependent
    launch (``triton.enable_pdl``): each Inductor kernel then waits for its predecessor
    before reading what it wrote and releases its successor after that read, so the
    compiled MoE routing joins the PDL chain of ingot's decode kernels
    (``ingot/ops/triton/pdl.py``; Qwen3-30B-A3B shape, batch 1, H200: compiled step
    0.990x back to back, 0.985x alone). ``strict`` adds
    ``fallback_random``, ``eager_numerics.disable_ftz`` and ``deterministic``
    where present; ``autotune_gemm`` adds ``max_autotune_gemm`` (GEMMs only:
    the rest of max-autotune would also retune our opaque kernels' neighbours
    and turn on Inductor's own CUDA graphs).
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
    if strict:
        for name in _STRICT_OPTIONS:
            if has_option(inductor_config, name):
                opts[name] = True
    if autotune_gemm and has_option(inductor_config, "max_autotune_gemm"):
        opts["max_autotune_gemm"] = True
    return opts


def dynamo_limit_names(dynamo_config: Any) -> tuple[str, ...]:
    """Names of the per-code and accumulated recompile limits ``dynamo_config`` has."""
    names = _NEW_LIMITS if has_option(dynamo_config, _NEW_LIMITS[0]) else _OLD_LIMITS
    return tuple(n for n in names if has_option(dynamo_config, n))


def skip_rule_targets(config: EngineConfig) -> list[str]:
    """Module names to register as Dynamo skip rules (defaults + ``compile_skip_modules``)."""
    out: list[str] = []
    for name in (*DEFAULT_SKIP_MODULES, *config.compile_skip_modules):
        name = name.strip()
        if name and name not in out:
            out.append(name)
    return out


def parse_torch_version(version: str) -> Optional[tuple[int, int]]:
    """(major, minor) of a version string like ``2.11.0+cu130`` or ``2.13.0a0+git1234``."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def supported(version: Optional[str] = None) -> tuple[bool, str]:
    """(whether decode compile can run on this PyTorch, why / what was found)."""
    v = str(torch.__version__ if version is None else version)
    parsed = parse_torch_version(v)
    if parsed is None:
        return False, f"cannot parse the PyTorch version {v!r}"
    if parsed < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return False, f"decode compile needs PyTorch >= {need}, found {v}"
    return True, f"PyTorch {v}"
