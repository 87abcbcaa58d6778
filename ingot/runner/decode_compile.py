"""Opt-in ``torch.compile`` (Inductor) of the decode forward, applied before CUDA-graph capture.

With ``EngineConfig.decode_compile`` on, the graph runner captures a compiled
decode forward instead of the raw one: Inductor fuses the PyTorch glue between
our opaque custom ops (``torch.ops.ingot.*``), and the fusible ops listed in
``compile_native_ops`` run in their PyTorch form (the graph runner builds the
forward it hands over here with that ``OpPolicy``) so Inductor can fuse them too. The CUDA graph is still ours: Inductor's own
cudagraphs stay off and ``mode=`` is never passed.

The pieces:

* pure helpers (``compile_options.py``): ``inductor_options``,
  ``dynamo_limit_names``, ``SKIP_MODULES``;
* the one side effect: ``configure_process`` (Dynamo limits, Dynamo skip
  rules, persistent cache directories);
* ``build_decode_forward`` (the wrapper the graph runner captures) and
  ``forbid_recompiles`` (used around capture);
* ``compile_stats.py``: ``stats_snapshot`` / ``stats_since`` -> ``CompileStats``
  (graph breaks, recompiles with reasons, compile seconds, per bucket).

Threads: from PyTorch 2.12, ``torch._dynamo.config``/``torch._inductor.config``
assignments are stored in ``ContextVar``s, i.e. per thread (a new thread sees
the defaults again). ``configure_process`` must therefore run in the thread
that compiles and captures; it applies the Dynamo limits once per thread when
the installed config is thread-local (once per process otherwise), and the
compiled wrapper re-checks this cheaply on every call, so compiling from
another thread is safe too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

from ingot.config import EngineConfig
from ingot.ops import library
from ingot.runner import inductor_fallbacks
from ingot.runner.compile_options import SKIP_MODULES, dynamo_limit_names, inductor_options

log = logging.getLogger(__name__)

DYNAMO_LIMIT = 1024

_LOCK = threading.RLock()
_PROCESS_DONE = False  # cache dirs set; limits applied too when config is process-global
_THREAD = threading.local()  # .limits_done: limits applied in this thread
_TRIED: set[str] = set()  # module names considered for a skip rule (each once)
_SKIPPED: list[str] = []  # modules registered as skip rules so far
_WARNED: set[str] = set()


def configure_process() -> None:
    """Process setup for the decode compile; idempotent and thread-safe.

    * raises the Dynamo recompile limits to ``DYNAMO_LIMIT`` (one compile per
      bucket must never fall back to eager);
    * registers the importable ``SKIP_MODULES`` as Dynamo skip rules;
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
        _register_skip_rules(SKIP_MODULES)
        if not getattr(_THREAD, "limits_done", False):
            if not _PROCESS_DONE or _config_is_thread_local():
                _raise_dynamo_limits()
                _tag_compile_caches()
            _THREAD.limits_done = True
        _PROCESS_DONE = True


def _tag_compile_caches() -> None:
    """Put the ingot ops' schema digest in torch.compile's cache key (``cache_key_tag``, where
    the installed PyTorch has it): a cached graph compiled against other schemas (an older
    ingot, another checkout) would call the ops with the wrong arguments."""
    import torch.compiler.config as compiler_config

    if not hasattr(compiler_config, "cache_key_tag"):
        return
    tag = f"ingot-ops-{library.schema_digest()}"
    if tag not in compiler_config.cache_key_tag.split():
        compiler_config.cache_key_tag = " ".join([*compiler_config.cache_key_tag.split(), tag])


def _ensure_thread_configured() -> None:
    """Fast path for the compiled wrapper: configure this thread if it is new."""
    if not getattr(_THREAD, "limits_done", False):
        configure_process()


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
    """Make Dynamo skip (never trace into) module ``name``; False (and a warning) if impossible."""
    try:
        from torch._dynamo import trace_rules

        trace_rules.add(name)
        return True
    except Exception as exc:
        _warn_once(f"skip:{name}", "could not register %r as a Dynamo skip rule (%s)", name, exc)
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

    ``forward`` comes back unchanged when ``config.decode_compile`` is off or the
    device is not CUDA (unless ``allow_cpu``, for tests). Otherwise the wrapper calls
    ``torch.compile(forward, fullgraph=False, backend=backend, options=...)``; it has
    ``.compiled = True`` and ``.raw = forward``. Compilation itself is lazy, so
    the caller's warm-up compiles.

    ``dynamic`` is left to Dynamo's automatic dynamic shapes: the first bucket
    compiles static, the second recompiles with the batch dim symbolic, and every
    later bucket reuses that graph (batch 1 gets its own, as Dynamo specializes
    sizes 0 and 1). Only the batch dim changes between buckets (the block table
    width is fixed per engine), so 3 compiles serve any number of buckets.
    """
    if getattr(forward, "compiled", False):
        return forward  # already wrapped
    if not config.decode_compile:
        return forward
    if torch.device(device).type != "cuda" and not allow_cpu:
        log.info("decode_compile is on but the device is %s: decode runs uncompiled", device)
        return forward
    configure_process()
    options = None
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        options = inductor_options(inductor_config)
        inductor_fallbacks.register_op_fallbacks()  # before the model: see inductor_fallbacks.py
    compiled = torch.compile(forward, fullgraph=False, backend=backend, options=options)

    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        _ensure_thread_configured()
        return compiled(*args, **kwargs)

    functools.update_wrapper(compiled_forward, forward, updated=())
    compiled_forward.compiled = True  # type: ignore[attr-defined]
    compiled_forward.raw = forward  # type: ignore[attr-defined]
    return compiled_forward


@contextlib.contextmanager
def forbid_recompiles() -> Iterator[None]:
    """Within the block, a Dynamo (re)compile raises instead of silently compiling."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield
