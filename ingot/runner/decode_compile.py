"""Opt-in ``torch.compile`` (Inductor) of the decode forward, applied before CUDA-graph capture.

With ``EngineConfig.decode_compile`` on, the graph runner captures a compiled
decode forward instead of the raw one: Inductor fuses the PyTorch glue between
our opaque custom ops (``torch.ops.ingot.*``), and the fusible ops listed in
``compile_native_ops`` run in their PyTorch form (``ingot.ops.native_ops``) so
Inductor can fuse them too. The CUDA graph is still ours: Inductor's own
cudagraphs stay off and ``mode=`` is never passed.

The pieces:

* pure helpers: ``inductor_options``, ``dynamo_limit_names``,
  ``skip_rule_targets``, ``supported``;
* the one side effect: ``configure_process`` (Dynamo limits, Dynamo skip
  rules, persistent cache directories);
* ``build_decode_forward`` (the wrapper the graph runner captures) and
  ``forbid_recompiles`` (used around capture);
* ``stats_snapshot`` / ``stats_since`` -> ``CompileStats`` (graph breaks,
  recompiles with reasons, compile seconds, per bucket).

PyTorch versions (>= 2.8 supported). Option names move between releases, so
every name is looked up on the installed config before use and absent ones
are dropped (Inductor rejects unknown options):

* division rounding: ``emulate_divison_rounding`` (2.10, sic) became
  ``eager_numerics.division_rounding`` (2.11+); neither exists in 2.8/2.9;
* strict numerics: ``fallback_random`` (all), ``deterministic`` (2.10+),
  ``eager_numerics.disable_ftz`` (newer; present in 2.13);
* Dynamo limits: ``recompile_limit``/``accumulated_recompile_limit`` (2.7+;
  the old ``cache_size_limit`` names are aliases) else the old names.

Threads: from PyTorch 2.12, ``torch._dynamo.config``/``torch._inductor.config``
assignments are stored in ``ContextVar``s, i.e. per thread (a new thread sees
the defaults again). ``configure_process`` must therefore run in the thread
that compiles and captures; it applies the Dynamo limits once per thread when
the installed config is thread-local (once per process otherwise), and the
compiled wrapper re-checks this cheaply on every call, so compiling from
another thread is safe too.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import importlib.util
import logging
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

from ingot.config import EngineConfig
from ingot.ops import native_ops
from ingot.runner import inductor_fallbacks

log = logging.getLogger(__name__)

MIN_TORCH = (2, 8)
DYNAMO_LIMIT = 1024
# Modules Dynamo must never trace into (kernel launchers, attention wrappers).
DEFAULT_SKIP_MODULES = ("triton", "flash_attn", "flash_attn_interface")

# Division rounding like eager: the newest name first (only one is returned).
_DIVISION_ROUNDING = ("eager_numerics.division_rounding", "emulate_divison_rounding")
_STRICT_OPTIONS = ("fallback_random", "eager_numerics.disable_ftz", "deterministic")
_NEW_LIMITS = ("recompile_limit", "accumulated_recompile_limit")
_OLD_LIMITS = ("cache_size_limit", "accumulated_cache_size_limit")

# ---------------------------------------------------------------- pure pieces


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
    casts and division rounding where the version has them. ``strict`` adds
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


# ---------------------------------------------------------- the side effect

_LOCK = threading.RLock()
_PROCESS_DONE = False  # cache dirs set; limits applied too when config is process-global
_THREAD = threading.local()  # .limits_done: limits applied in this thread
_TRIED: set[str] = set()  # module names considered for a skip rule (each once)
_SKIPPED: list[str] = []  # modules registered as skip rules so far
_WARNED: set[str] = set()


def configure_process(config: EngineConfig) -> None:
    """Process setup for the decode compile; idempotent and thread-safe.

    * raises the Dynamo recompile limits to ``DYNAMO_LIMIT`` (one compile per
      bucket must never fall back to eager);
    * registers ``skip_rule_targets(config)`` that are importable as Dynamo
      skip rules (a later config only adds the modules not yet registered);
    * points ``TORCHINDUCTOR_CACHE_DIR``/``TRITON_CACHE_DIR`` at
      ``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/ingot/{inductor,triton}`` unless
      the user set them (defaults Inductor wrote there itself don't count:
      importing ``torch._inductor`` sets the variable). Inductor's compile
      workers inherit the environment when they start, so configure before the
      first compile.

    Call it in the thread that compiles and captures: on PyTorch >= 2.12 the
    config is per thread, and the limits are then applied once per thread.
    """
    global _PROCESS_DONE
    with _LOCK:
        if not _PROCESS_DONE:
            _set_cache_dirs()
        _register_skip_rules(skip_rule_targets(config))
        if not getattr(_THREAD, "limits_done", False):
            if not _PROCESS_DONE or _config_is_thread_local():
                _raise_dynamo_limits()
            _THREAD.limits_done = True
        _PROCESS_DONE = True


def _ensure_thread_configured(config: EngineConfig) -> None:
    """Fast path for the compiled wrapper: configure this thread if it is new."""
    if not getattr(_THREAD, "limits_done", False):
        configure_process(config)


@functools.lru_cache(maxsize=None)
def _config_is_thread_local() -> bool:
    """Whether config assignments are per thread (``ContextVar`` overrides, PyTorch >= 2.12)."""
    try:
        import torch._dynamo.config as dynamo_config

        entries = dynamo_config._config  # private layout; any failure = assume per thread
        entry = next(iter(entries.values()))
        return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)
    except Exception:
        return True  # re-applying per thread is harmless


def _raise_dynamo_limits() -> None:
    import torch._dynamo.config as dynamo_config

    for name in dynamo_limit_names(dynamo_config):
        try:
            current = getattr(dynamo_config, name)
            if not isinstance(current, int) or current < DYNAMO_LIMIT:
                setattr(dynamo_config, name, DYNAMO_LIMIT)
        except Exception as exc:  # pragma: no cover - depends on the torch build
            _warn_once(f"limit:{name}", "could not raise torch._dynamo.config.%s: %s", name, exc)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _register_skip_rules(names: list[str]) -> list[str]:
    """Register the importable ``names`` not registered yet; returns those registered now."""
    done = []
    for name in names:
        if name in _TRIED:
            continue
        _TRIED.add(name)
        if not _importable(name):
            continue
        if _add_skip_rule(name):
            _SKIPPED.append(name)
            done.append(name)
    return done


def _add_skip_rule(name: str) -> bool:
    """Make Dynamo skip (never trace into) module ``name``; False (and a warning) if impossible.

    ``torch._dynamo.trace_rules.add(module_name)`` (PyTorch >= 2.2; earlier
    ``torch._dynamo.skipfiles.add``) appends the module's directory to
    ``SKIP_DIRS``. The manual append is the last resort for a release that
    drops ``add`` but keeps the list.
    """
    errors = []
    try:
        from torch._dynamo import trace_rules
    except Exception as exc:  # pragma: no cover - very old or very new torch
        trace_rules = None
        errors.append(f"import trace_rules: {exc}")
    add = getattr(trace_rules, "add", None)
    if add is None:
        with contextlib.suppress(Exception):
            from torch._dynamo import skipfiles  # type: ignore[attr-defined]

            add = getattr(skipfiles, "add", None)
    if callable(add):
        try:
            add(name)
            return True
        except Exception as exc:
            errors.append(f"add: {exc}")
    try:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec else None
        skip_dirs = getattr(trace_rules, "SKIP_DIRS")
        recompile = getattr(trace_rules, "_recompile_re")
        if origin:
            path = origin[: -len("__init__.py")] if origin.endswith("__init__.py") else origin
            skip_dirs.append(Path(path).as_posix())
            recompile()
            return True
    except Exception as exc:
        errors.append(f"SKIP_DIRS: {exc}")
    _warn_once(f"skip:{name}", "could not register %r as a Dynamo skip rule (%s)", name, "; ".join(errors))
    return False


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME`` (if absolute) or ``~/.cache``; the temp dir when there is no home."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg)
    try:
        return Path.home() / ".cache"
    except RuntimeError:  # no home directory
        return Path(tempfile.gettempdir())


def _inductor_default_cache_dir() -> Optional[str]:
    """Inductor's own default cache dir, if Inductor has been imported (else None).

    Importing ``torch._inductor`` writes its default into ``TORCHINDUCTOR_CACHE_DIR``
    (``cache_dir_utils.cache_dir()``), and its first Triton kernel writes
    ``<that>/triton/<device>`` into ``TRITON_CACHE_DIR``. Such values are
    Inductor's, not the user's; before that import any value is the user's.
    """
    mod = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if mod is None:
        return None
    try:
        return os.path.abspath(mod.default_cache_dir())
    except Exception:
        return None


def _set_cache_dirs() -> None:
    """Point the Inductor/Triton caches under ``user_cache_dir()/ingot`` unless the user chose them."""
    base = user_cache_dir() / "ingot"
    default = _inductor_default_cache_dir()
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor is None or (default is not None and os.path.abspath(inductor) == default):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inductor")
    triton = os.environ.get("TRITON_CACHE_DIR")
    # Inductor's own choice is <its default dir>/triton/<device index>
    auto_triton = triton is not None and default is not None
    auto_triton = auto_triton and os.path.dirname(os.path.abspath(triton)) == os.path.join(default, "triton")
    if triton is None or auto_triton:
        os.environ["TRITON_CACHE_DIR"] = str(base / "triton")


def _warn_once(key: str, msg: str, *args: Any) -> None:
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    log.warning(msg, *args)


def _reset_for_tests() -> None:
    """Forget that the process/threads were configured (tests only; skip rules stay)."""
    global _PROCESS_DONE, _THREAD
    with _LOCK:
        _PROCESS_DONE = False
        _THREAD = threading.local()
        _TRIED.clear()
        _SKIPPED.clear()
        _WARNED.clear()
        _config_is_thread_local.cache_clear()


# ------------------------------------------------------------------ builder


def build_decode_forward(
    forward: Callable[..., Any],
    config: EngineConfig,
    device: Union[torch.device, str],
    *,
    backend: Union[str, Callable[..., Any]] = "inductor",
    allow_cpu: bool = False,
) -> Callable[..., Any]:
    """The decode forward to capture: ``forward`` itself, or a compiled wrapper of it.

    ``forward`` comes back unchanged when ``config.decode_compile`` is off, the
    device is not CUDA (unless ``allow_cpu``, for tests), or this PyTorch is
    too old (warned once). Otherwise the wrapper calls
    ``torch.compile(forward, fullgraph=False, dynamic=..., backend=backend,
    options=...)`` inside ``native_ops(config.compile_native_ops)``; it has
    ``.compiled = True`` and ``.raw = forward``. Compilation itself is lazy, so
    the caller's warm-up compiles.

    ``config.compile_dynamic_batch`` (default) leaves ``dynamic`` to Dynamo's
    automatic dynamic shapes: the first bucket compiles static, the second
    recompiles with the batch dim symbolic, and every later bucket reuses that
    graph (batch 1 gets its own, as Dynamo specializes sizes 0 and 1). Only the
    batch dim changes between buckets (the block table width is fixed per
    engine), so 3 compiles serve any number of buckets. Off: ``dynamic=False``,
    one static compile per bucket.
    """
    if getattr(forward, "compiled", False):
        return forward  # already wrapped
    if not config.decode_compile:
        return forward
    if torch.device(device).type != "cuda" and not allow_cpu:
        log.info("decode_compile is on but the device is %s: decode runs uncompiled", device)
        return forward
    ok, why = supported()
    if not ok:
        _warn_once("unsupported", "decode_compile disabled: %s", why)
        return forward

    configure_process(config)
    options = None
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        options = inductor_options(inductor_config, config.compile_strict_numerics, config.compile_autotune_gemm)
        inductor_fallbacks.register_op_fallbacks()  # before the model: see inductor_fallbacks.py
    dynamic = None if config.compile_dynamic_batch else False
    compiled = torch.compile(forward, fullgraph=False, dynamic=dynamic, backend=backend, options=options)
    # Dynamo guards the policy global by value (``_NATIVE == frozenset(...)``);
    # one frozenset for every call also keeps its identity stable.
    native = frozenset(config.compile_native_ops)

    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        _ensure_thread_configured(config)
        with native_ops(native):
            return compiled(*args, **kwargs)

    functools.update_wrapper(compiled_forward, forward, updated=())
    compiled_forward.compiled = True  # type: ignore[attr-defined]
    compiled_forward.raw = forward  # type: ignore[attr-defined]
    return compiled_forward


@contextlib.contextmanager
def forbid_recompiles() -> Iterator[None]:
    """Within the block, a Dynamo (re)compile raises instead of silently compiling.

    ``torch.compiler.set_stance("fail_on_recompile")`` (PyTorch >= 2.6), else
    ``torch._dynamo.config.patch(error_on_recompile=True)``.
    """
    ctx: Any = None
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is not None:
        try:
            ctx = set_stance("fail_on_recompile")
        except Exception:  # unknown stance on this version
            ctx = None
    if ctx is None:
        import torch._dynamo.config as dynamo_config

        ctx = dynamo_config.patch(error_on_recompile=True)
    with ctx:
        yield


# -------------------------------------------------------------------- stats


@dataclass(frozen=True)
class StatsSnapshot:
    """Dynamo's bookkeeping at one moment (see ``stats_snapshot``)."""

    time: float
    metrics: Optional[tuple[Any, ...]]  # CompilationMetrics records (kept alive: compared by identity)
    break_records: Optional[int]  # len(torch._dynamo.utils.graph_break_reasons)
    break_tail: Any  # its last record (identity tells a reset() apart from growth)
    break_counts: dict[str, int]  # counters["graph_break"]
    guard_failures: dict[Any, tuple[list, int]]  # code -> (its reasons list, length)
    unique_graphs: int
    compile_inner: Optional[tuple[int, float]]  # compilation_time_metrics["_compile.compile_inner"]


@dataclass
class CompileStats:
    """What Dynamo did between a snapshot and now (one bucket's warm-up)."""

    graph_breaks: int = 0
    graph_break_reasons: list[str] = field(default_factory=list)
    recompiles: int = 0
    recompile_reasons: list[str] = field(default_factory=list)
    frames: int = 0  # frames Dynamo compiled (first compiles + recompiles, resume functions too)
    graphs: int = 0  # graphs handed to the backend
    compile_seconds: Optional[float] = None  # Dynamo + backend time; None if unknown
    wall_seconds: float = 0.0

    def describe(self) -> str:
        secs = "?" if self.compile_seconds is None else f"{self.compile_seconds:.2f}s"
        parts = [
            f"{self.graphs} graph(s) from {self.frames} frame(s) in {secs}",
            f"{self.graph_breaks} graph break(s)",
            f"{self.recompiles} recompile(s)",
        ]
        text = ", ".join(parts)
        for reason, n in collections.Counter(self.graph_break_reasons).items():
            text += f"\n  break x{n}: {reason}"
        for reason, n in collections.Counter(self.recompile_reasons).items():
            text += f"\n  recompile x{n}: {reason}"
        return text


def _utils() -> Any:
    import torch._dynamo.utils as utils

    return utils


def _metrics_records() -> Optional[tuple[Any, ...]]:
    get = getattr(_utils(), "get_compilation_metrics", None)
    if get is None:
        return None
    return tuple(get())


def stats_snapshot() -> StatsSnapshot:
    """Dynamo's counters now; pass to ``stats_since`` after warm-up."""
    utils = _utils()
    counters = utils.counters
    metrics = None
    with contextlib.suppress(Exception):
        metrics = _metrics_records()
    reasons = getattr(utils, "graph_break_reasons", None)
    inner = getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner")
    return StatsSnapshot(
        time=time.perf_counter(),
        metrics=metrics,
        break_records=len(reasons) if isinstance(reasons, list) else None,
        break_tail=reasons[-1] if isinstance(reasons, list) and reasons else None,
        break_counts=dict(counters["graph_break"]),
        guard_failures={code: (v, len(v)) for code, v in getattr(utils, "guard_failures", {}).items()},
        unique_graphs=counters["stats"]["unique_graphs"],
        compile_inner=(len(inner), sum(inner)) if inner is not None else None,
    )


def _first_line(text: Any) -> str:
    lines = str(text).strip().splitlines()
    return lines[0].strip() if lines else ""


def _break_reasons(snap: StatsSnapshot) -> list[str]:
    """One entry per graph break since ``snap``: 'reason (file:line)'."""
    utils = _utils()
    records = getattr(utils, "graph_break_reasons", None)
    if snap.break_records is not None and isinstance(records, list):
        start = snap.break_records
        if start and (len(records) < start or records[start - 1] is not snap.break_tail):
            start = 0  # torch._dynamo.reset() cleared the list since the snapshot
        out = []
        for rec in records[start:]:
            text = _first_line(getattr(rec, "reason", rec))
            stack = getattr(rec, "user_stack", None) or []
            if stack:
                frame = stack[-1]
                text += f" ({frame.filename}:{frame.lineno})"
            out.append(text)
        return out
    out = []
    for reason, n in utils.counters["graph_break"].items():
        out.extend([_first_line(reason)] * max(0, n - snap.break_counts.get(reason, 0)))
    return out


def stats_since(snap: StatsSnapshot) -> CompileStats:
    """Graph breaks, recompiles (with reasons), graphs and compile seconds since ``snap``.

    Sources, in order of preference (all degrade to what the version has):
    ``torch._dynamo.utils.get_compilation_metrics()`` (one record per compiled
    frame, with ``recompile_reason`` and ``entire_frame_compile_time_s``),
    ``utils.graph_break_reasons`` / ``counters["graph_break"]`` and, if the
    metrics are missing, ``utils.guard_failures`` (which lists one reason per
    failing cache entry, so it over-counts) and ``compilation_time_metrics``.
    The metrics deque keeps the last 64 records: a bucket compiling more
    frames than that loses the oldest. Compiles in other threads are counted too.
    """
    stats = CompileStats(wall_seconds=time.perf_counter() - snap.time)
    utils = _utils()
    with contextlib.suppress(Exception):
        reasons = _break_reasons(snap)
        stats.graph_breaks, stats.graph_break_reasons = len(reasons), reasons
    with contextlib.suppress(Exception):
        stats.graphs = max(0, utils.counters["stats"]["unique_graphs"] - snap.unique_graphs)

    records = None
    with contextlib.suppress(Exception):
        records = _metrics_records() if snap.metrics is not None else None
    if records is not None and all(hasattr(m, "recompile_reason") for m in records):
        seen = {id(m) for m in snap.metrics or ()}
        new = [m for m in records if id(m) not in seen]
        seconds = 0.0
        for m in new:
            # runtime records: compile work done at the first call (Triton compile/autotune)
            if not getattr(m, "is_runtime", False):
                stats.frames += 1
            if m.recompile_reason:
                stats.recompiles += 1
                stats.recompile_reasons.append(f"{getattr(m, 'co_name', '?')}: {_first_line(m.recompile_reason)}")
            micros = getattr(m, "duration_us", None)
            seconds += micros / 1e6 if micros else getattr(m, "entire_frame_compile_time_s", None) or 0.0
        stats.compile_seconds = seconds
        return stats

    with contextlib.suppress(Exception):  # older layout: guard failures (an upper bound)
        for code, failures in getattr(utils, "guard_failures", {}).items():
            old, before = snap.guard_failures.get(code, (None, 0))
            fresh = failures[before:] if old is failures else failures
            for reason in fresh:
                stats.recompile_reasons.append(f"{getattr(code, 'co_name', '?')}: {_first_line(reason)}")
        stats.recompiles = len(stats.recompile_reasons)
    with contextlib.suppress(Exception):
        inner = getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner")
        if inner is not None:
            count, total = snap.compile_inner or (0, 0.0)
            if len(inner) < count:
                count, total = 0, 0.0
            stats.frames = len(inner) - count
            stats.compile_seconds = max(0.0, sum(inner) - total)
    return stats
