"""Build a model on its device and fill it: from a checkpoint, or randomly (``load_format="dummy"``)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Iterator, Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ingot.distributed.parallel import SINGLE, TensorParallel
from ingot.loading.checkpoint import Checkpoint, open_checkpoint
from ingot.config import ConfigError, EngineConfig
from ingot.loading.errors import CheckpointError
from ingot.loading.model_config import ModelConfig
from ingot.models.registry import MODEL_CLASSES, model_class


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_position: int, tp: TensorParallel = SINGLE
) -> nn.Module:
    """Allocate the model (``tp``'s shard of it) directly on ``device`` in ``dtype`` (weights uninitialised)."""
    cls = model_class(cfg)
    with torch.device(device), default_dtype(dtype):
        model = cls(cfg, max_position, tp=tp) if tp.enabled else cls(cfg, max_position)
    return model.eval().requires_grad_(False)


def held_dense(cfg: ModelConfig) -> Sequence[str]:
    """The linear modules the model class of ``cfg`` holds in the model dtype whatever the
    checkpoint stores (its ``DENSE_MODULES``), for ``open_checkpoint`` to hand over dense."""
    return getattr(MODEL_CLASSES.get(cfg.architecture), "DENSE_MODULES", ())


def open_model(config: EngineConfig, dequantize_on_load: Optional[bool] = None) -> Checkpoint:
    """The checkpoint ``config`` names, opened for where it runs: a quantized checkpoint's (or an
    online-quantized model's) linear layers stay quantized on CUDA, where ingot's kernels
    multiply them, and are dequantized at load elsewhere (the references would dequantize
    them at every step), unless ``dequantize_on_load`` says otherwise; the modules the model
    holds dense (``held_dense``) come dense either way."""
    if dequantize_on_load is None:
        dequantize_on_load = resolve_device(config.device).type != "cuda"
    return open_checkpoint(config.model, config.tokenizer, config.load_format, config.quantization,
                           dequantize_on_load=dequantize_on_load, held_dense=held_dense)


def load_checkpoint(
    ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, max_position: int, progress: bool = True,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    """The model filled from ``ckpt`` (seeded random weights when it has none); under tensor
    parallelism only this rank's part of each tensor is read (``model.checkpoint_slice``).
    A quantized checkpoint's linear layers hold its quantized weights (``ckpt.quant``), unless
    its iterator dequantizes them (``ckpt.quant`` is then None)."""
    cfg = ckpt.config if ckpt.quant is None else dataclasses.replace(ckpt.config, quant=ckpt.quant)
    model = build_model(cfg, dtype, device, max_position, tp)
    if ckpt.weights is None:
        return init_random(model)
    select = model.checkpoint_slice if tp.enabled else None
    weights = tqdm(ckpt.weights(dtype, select), total=ckpt.num_tensors, desc="Loading weights", unit=" tensors",
                   disable=not progress, leave=False)
    try:
        model.load_weights(weights)
    finally:
        weights.close()
    return model


def init_random(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Random weights (norms at 1) for shape-only benchmarks; deterministic per seed. Quantized
    layers get random codes, scales that give the same spread, zero points at mid-range and
    the identity act-order permutation."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        # FusedMoE's stacked quantized experts name their parts w_gate_up_qweight, w_down_scale, ...
        leaf = re.sub(r"^w_(?:gate_up|down)_", "", name.rpartition(".")[2])
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif leaf in ("bias", "mins"):
            param.data.zero_()
        elif leaf == "perm":
            param.data.copy_(torch.arange(param.numel(), device=device))
        elif leaf == "zeros":
            param.data.fill_(8)
        elif leaf == "qweight":
            param.data.copy_(torch.randint(-2**31, 2**31, param.shape, generator=gen, device=device, dtype=torch.int64))
        elif leaf == "scales":
            param.data.fill_(std / 2.5)  # uniform int4 codes around their midpoint: about std
        elif leaf in ("weight_scale", "scale"):
            param.data.fill_(std)
        elif param.dtype == torch.float8_e4m3fn:
            param.data.copy_(torch.randn(param.shape, generator=gen, device=device).to(param.dtype))
        else:
            param.data.normal_(0.0, std, generator=gen)
    return model


def resolve_dtype(name: str, device: torch.device, model_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """'auto' on CUDA: the checkpoint's half dtype if it has one, else bf16 (fp16 without
    bf16 support); on CPU fp32 (half-precision matmuls are slow there)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32
    bf16_ok = torch.cuda.is_bf16_supported()
    if model_dtype == torch.float16 or (model_dtype != torch.bfloat16 and not bf16_ok):
        return torch.float16
    return torch.bfloat16 if bf16_ok else torch.float16


def device_memory(device: torch.device) -> Optional[int]:
    """Total bytes of a CUDA device (None for the CPU): what device-dependent defaults
    (``EngineConfig.for_device``) look at."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def resolve_device(name: str) -> torch.device:
    """The device of ``name``; a CUDA device always with its index (the current GPU when
    ``name`` gives none), so that any thread can make it current."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda was requested but PyTorch sees no CUDA GPU")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device
