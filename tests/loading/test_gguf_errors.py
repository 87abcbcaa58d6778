"""GGUF reader errors: missing, corrupt and truncated files, unsupported architectures and
tensors, each a CheckpointError that names the problem."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import load_gguf
from tests.loading.gguf_fixtures import RNG, tiny_state_dict, to_gguf, write_gguf


def test_missing_file() -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        load_gguf("/nonexistent/model.gguf")


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "empty"),
        (b"GGU", "bad magic"),
        (b"NOPE" + bytes(100), "bad magic"),
        (bytes(RNG.integers(0, 256, 4096, dtype=np.uint8)), "not a valid GGUF"),
        (b"GGUF" + (1).to_bytes(4, "little") + bytes(64), "version 1"),
        (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little") + (2**40).to_bytes(8, "little"), "truncated"),
    ],
    ids=["empty", "short", "magic", "random", "v1", "huge-string"],
)
def test_corrupt_files(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        load_gguf(path)


def test_truncated_tiny_file(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", tensors=to_gguf(tiny_state_dict(), permute=True))
    data = path.read_bytes()
    for cut in (len(data) - 10, len(data) // 2, 100):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            load_gguf(path)


def test_unsupported_architecture_and_tensors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="unsupported architecture 'gpt2'"):
        load_gguf(write_gguf(tmp_path / "a.gguf", "gpt2"))
    with pytest.raises(CheckpointError, match="expert_used_count"):  # experts (Mixtral) need their top-k
        load_gguf(write_gguf(tmp_path / "b.gguf", meta=lambda w: w.add_uint32("llama.expert_count", 8)))
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_norm_exps\.weight"):
        load_gguf(write_gguf(tmp_path / "c.gguf", tensors={"blk.0.ffn_norm_exps.weight": np.zeros((4, 64), np.float32)}))
    with pytest.raises(CheckpointError, match="embedding_length"):
        load_gguf(write_gguf(tmp_path / "d.gguf", hparams=False))
