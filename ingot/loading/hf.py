"""HF model directories (config.json + safetensors + tokenizer.json) and hub ids."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open

from ingot.loading.errors import CheckpointError
from ingot.loading.weights import WeightSelector

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing {path.name} in {path.parent}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a directory: one model.safetensors, or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        missing = [n for n in names if not (path / n).exists()]
        if not names or missing:
            raise CheckpointError(f"{index} names missing shards: {missing or 'none listed'}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no .safetensors weights (other formats are not supported)")
    return files


def count_tensors(files: list[Path]) -> int:
    """Tensors across the files (header reads only), for the loading progress bar."""
    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                total += len(f.keys())
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"corrupt or truncated safetensors file {file}: {exc}") from None
    return total


# safetensors dtype names -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def tensor_table(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], Optional[torch.dtype]]]:
    """Every tensor's file, shape and dtype (None: a dtype torch lacks), from the files' headers alone."""
    table: dict[str, tuple[Path, tuple[int, ...], Optional[torch.dtype]]] = {}
    for file in files:
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, struct.error, ValueError) as exc:
            raise CheckpointError(f"corrupt or truncated safetensors file {file}: {exc}") from None
        for name, info in header.items():
            if name != "__metadata__":
                table[name] = (file, tuple(info["shape"]), SAFETENSORS_DTYPES.get(info["dtype"]))
    return table


def iter_safetensors(
    files: list[Path], dtype: torch.dtype, select: Optional[WeightSelector] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor cast to dtype), one tensor at a time (memory-mapped); with
    ``select``, only the part of each tensor it names is read from the file."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    index = select(name) if select is not None else None
                    tensor = f.get_tensor(name) if index is None else f.get_slice(name)[index]
                    yield name, tensor.to(dtype)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"corrupt or truncated safetensors file {file}: {exc}") from None


def generation_eos_ids(path: Path) -> list[int]:
    gen = path / "generation_config.json"
    if not gen.exists():
        return []
    eos = read_json(gen).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


def download_from_hub(repo_id: str, weights: bool = True, patterns: Optional[list[str]] = None) -> Path:
    """Fetch a hub model (configs, tokenizer and, with ``weights``, the weights; or the files
    ``patterns`` match) into the HF cache."""
    from huggingface_hub import snapshot_download

    if patterns is None:
        patterns = HUB_PATTERNS if weights else [p for p in HUB_PATTERNS if p != "*.safetensors"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repo, auth...
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = "HF_HUB_OFFLINE=1 is set" if offline else "the hub could not be reached or the repo does not exist"
        raise CheckpointError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({hint}: {type(exc).__name__}). "
            "Pass a local model directory or .gguf file instead."
        ) from None
