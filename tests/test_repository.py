"""The repository itself: no tracked file keeps the markers of an unresolved merge."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if p.suffix in {".py", ".md", ".toml", ".cfg", ".txt", ".sh", ".yml", ".yaml"} or p.name == "Makefile"]


def test_no_merge_conflict_markers():
    bad = []
    for path in _tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in MARKER.finditer(text):
            bad.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not bad, "unresolved merge markers: " + ", ".join(bad)


def test_the_marker_pattern_finds_a_conflict():
    assert MARKER.findall("a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> main\n") == ["<<<<<<< ", "=======", ">>>>>>> "]
