"""Report writers shared by the bench/check commands: rich tables, JSON files, line plots.

Nothing here measures anything or needs a GPU: the commands turn their results
into rows of strings (tables), plain dicts (JSON) or series (plots), and these
helpers write them. matplotlib is not a dependency of ingot; ``plot_lines``
imports it lazily and raises ``ReportError`` with the install hint if missing.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import platform
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

PLOT_INSTALL_HINT = "pip install matplotlib"


class ReportError(RuntimeError):
    """A report cannot be written (missing optional package, bad path...)."""


# ---------------------------------------------------------------------- environment
def env_info() -> dict[str, Any]:
    """Versions and the GPU a result was measured on (gpu is None without CUDA), and whether the
    decode kernels launched with programmatic dependent launch there (None without CUDA)."""
    import torch

    pdl: Optional[bool] = None
    try:
        import triton

        triton_version: Optional[str] = triton.__version__
        if torch.cuda.is_available():
            from ingot.ops.triton.pdl import pdl_supported

            pdl = pdl_supported(torch.device("cuda"))
    except ImportError:
        triton_version = None
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "pdl": pdl,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------- formatting
def fmt(value: Optional[float], spec: str = ".3f", missing: str = "-") -> str:
    """``value`` formatted with ``spec``; ``missing`` for None / NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


# ---------------------------------------------------------------------- tables
def make_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right_align: Sequence[str] = (),
    section_ends: Sequence[int] = (),
    caption: Optional[str] = None,
):
    """A rich Table; ``section_ends`` are row indices after which a separator is drawn."""
    from rich.table import Table

    table = Table(title=title, caption=caption, header_style="bold")
    for col in columns:
        table.add_column(col, justify="right" if col in right_align else "left", no_wrap=col in right_align)
    ends = set(section_ends)
    for i, row in enumerate(rows):
        table.add_row(*row, end_section=i in ends)
    return table


def console(width: Optional[int] = None):
    """A stdout console; ``width`` only applies when stdout is not a terminal."""
    from rich.console import Console

    con = Console()
    if width is not None and not con.is_terminal:
        con = Console(width=width)
    return con


def table_text(table, width: int = 200) -> str:
    """The table rendered as plain text (tests, logs)."""
    from rich.console import Console

    con = Console(width=width, record=True, file=_Null(), color_system=None)
    con.print(table)
    return con.export_text()


class _Null:
    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


# ---------------------------------------------------------------------- JSON
def jsonable(obj: Any) -> Any:
    """Dataclasses to dicts, tuples to lists, non-string keys to strings, NaN/inf to None."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` (made JSON-safe, strict JSON) to ``path``, creating its folder."""
    out = Path(path).expanduser()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(jsonable(data), indent=1, allow_nan=False) + "\n")
    except OSError as exc:
        raise ReportError(f"cannot write {out}: {exc}") from None
    return out


# ---------------------------------------------------------------------- plots
def require_matplotlib() -> None:
    """Raise ReportError with the install hint if matplotlib is not importable."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError(f"plotting needs matplotlib, which is not installed: {PLOT_INSTALL_HINT}") from None


def plot_lines(
    path: str | Path,
    x: Sequence[float],
    series: Mapping[str, Sequence[Optional[float]]],
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    dashed: Sequence[str] = (),
    log_x: bool = True,
) -> Path:
    """One line (with markers) per series against ``x``; None points are skipped.

    Series named in ``dashed`` are drawn as dashed grey-ish reference lines
    (e.g. a memory floor). The format follows the file suffix (png, svg, pdf).
    """
    require_matplotlib()
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    out = Path(path).expanduser()
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for name, ys in series.items():
        pts = [(xi, yi) for xi, yi in zip(x, ys) if yi is not None and not (isinstance(yi, float) and math.isnan(yi))]
        if not pts:
            continue
        xs, vals = zip(*pts)
        if name in dashed:
            ax.plot(xs, vals, linestyle="--", color="0.4", label=name)
        else:
            ax.plot(xs, vals, marker="o", label=name)
    if log_x and len(set(x)) > 1 and min(x) > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(x), [str(v) for v in x])
        ax.minorticks_off()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
    except OSError as exc:
        raise ReportError(f"cannot write {out}: {exc}") from None
    return out


# ---------------------------------------------------------------------- argument types
def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, duplicates dropped, order kept ('1,8,32')."""
    import argparse

    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers, e.g. 1,8,32")
    values = [positive_int(p) for p in parts]
    return list(dict.fromkeys(values))
