"""Quantized HF checkpoints (safetensors + ``quantization_config``) read into the canonical forms.

At open, the tensor table (headers only) is split into the quantized modules (those
with a format's marker tensor: ``weight_packed``, ``weight_scale``, ``qweight``,
``weight_scale_inv``) and everything else, and each quantized module's canonical
scheme is settled from its shapes, so the ``QuantConfig`` the model is built from is
known before any weight is read. While iterating, a quantized module's tensors are
read whole (wherever its shards put them), converted, then cut by the selector under
their canonical names; every other tensor is read exactly as ``hf.iter_safetensors``
reads it. The file decides which modules are quantized: where the config's ignore
patterns say otherwise, ``QuantConfig.per_module`` records what the file holds.
A quantized ``lm_head`` or embedding (GPTQ ``lm_head: true``) is dequantized at load, and
so is every module the model holds in the model dtype (``held_dense``, patterns as in
``QuantConfig.ignore``: DeepSeek's ``kv_b_proj``, which its latent attention reads as a
dense weight); ``QuantConfig.per_module`` names them dense.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open

from ingot.loading.errors import CheckpointError
from ingot.loading.hf import tensor_table
from ingot.loading.quant_config import HFQuant, StoredFormat, parse
from ingot.loading.quant_formats import MARKERS, PARTS, REFUSED_PARTS, convert, plan
from ingot.loading.quant_pack import canonical_names, dequantize
from ingot.loading.quant_scheme import LinearScheme, QuantConfig, module_matches
from ingot.loading.weights import WeightSelector, select as select_part

DENSE_ONLY = ("lm_head", "embed_tokens")  # modules the model keeps dense whatever the file holds


@dataclass(frozen=True)
class _Module:
    fmt: StoredFormat
    scheme: LinearScheme
    parts: dict[str, Path]  # tensor part (weight_packed, scales...) -> its file
    dense: bool  # dequantized at load (lm_head, embeddings, the modules the model holds dense)


class QuantizedSafetensors:
    """The weights of a quantized HF checkpoint, in canonical form (or dequantized)."""

    def __init__(self, files: list[Path], quantization_config: dict, source: str = "config.json",
                 held_dense: tuple[str, ...] = ()) -> None:
        self.spec: HFQuant = parse(quantization_config, source)
        self.held_dense = DENSE_ONLY + tuple(held_dense)
        self.table = tensor_table(files)
        self.files = files
        self.modules: dict[str, _Module] = {}
        for name in self.table:
            module, _, part = name.rpartition(".")
            if part in REFUSED_PARTS:
                raise CheckpointError(f"checkpoint tensor {name!r}: static activation, kv-cache or nvfp4 "
                                      "quantization scales are not supported")
            if part in MARKERS and module not in self.modules:
                self.modules[module] = self._plan_module(module)
        self.quant = self._quant_config()

    def _plan_module(self, module: str) -> _Module:
        fmt = self.spec.format_for(module)
        if fmt is None:
            raise CheckpointError(f"{module} is stored quantized but no quantization_config group targets it")
        if fmt.kind in ("ct-int8", "ct-fp8") and f"{module}.weight_packed" in self.table:
            raise CheckpointError(f"{module} is stored pack-quantized, its config group says {fmt.kind}")
        known = PARTS[fmt.kind][0] | PARTS[fmt.kind][1]
        if "weight" not in known and f"{module}.weight" in self.table:
            raise CheckpointError(f"{module} has both a dense weight and {fmt.kind} quantized tensors")
        parts = {p: self.table[f"{module}.{p}"] for p in known if f"{module}.{p}" in self.table}
        scheme = plan(module, fmt, {p: (shape, dtype) for p, (_, shape, dtype) in parts.items()})
        dense = module_matches(module, self.held_dense)
        return _Module(fmt, scheme, {p: file for p, (file, _, _) in parts.items()}, dense)

    def _quant_config(self) -> Optional[QuantConfig]:
        served = {m: mod.scheme for m, mod in self.modules.items() if not mod.dense}
        if not served:
            return None
        common = Counter(served.values()).most_common(1)[0][0]
        base = QuantConfig(self.spec.method, common, self.spec.ignore)
        per_module: dict[str, Optional[LinearScheme]] = {}
        for m, scheme in served.items():
            if base.scheme_for(m) != scheme:
                per_module[m] = scheme
        for m, mod in self.modules.items():
            if mod.dense:
                per_module[m] = None
        for name, (_, shape, _) in self.table.items():
            module = name.rpartition(".")[0]
            if module not in self.modules and name.endswith(".weight") and len(shape) == 2 \
                    and base.scheme_for(module) is not None:
                per_module[module] = None  # dense in the file though the config's patterns would quantize it
        return QuantConfig(self.spec.method, common, self.spec.ignore, per_module)

    def _owner(self, name: str) -> Optional[str]:
        """The quantized module ``name`` is a quantization tensor of (None: a tensor read as is)."""
        module, _, part = name.rpartition(".")
        mod = self.modules.get(module)
        return module if mod is not None and part in mod.parts else None

    def num_tensors(self, dequantize_all: bool = False) -> int:
        total = 0
        for name in self.table:
            owner = self._owner(name)
            if owner is None:
                total += 1
        for mod in self.modules.values():
            total += 1 if (mod.dense or dequantize_all) else len(canonical_names(mod.scheme))
        return total

    def weights(self, dtype: torch.dtype, select: Optional[WeightSelector] = None,
                dequantize_all: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) one module at a time: canonical tensors of the quantized modules
        (scales as stored; ``dequantize_all``: a dense ``weight`` in ``dtype`` instead), every
        other tensor cast to ``dtype``, each cut by ``select`` under the name it is yielded as."""
        done: set[str] = set()
        with contextlib.ExitStack() as stack:
            handles: dict[Path, object] = {}

            def handle(file: Path):
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
                return handles[file]

            for file in self.files:
                try:
                    names = list(handle(file).keys())
                    for name in names:
                        owner = self._owner(name)
                        if owner is None:
                            index = select(name) if select is not None else None
                            f = handle(file)
                            tensor = f.get_tensor(name) if index is None else f.get_slice(name)[index]
                            yield name, tensor.to(dtype)
                        elif owner not in done:
                            done.add(owner)
                            yield from self._module(owner, handle, dtype, select, dequantize_all)
                except (SafetensorError, OSError) as exc:
                    raise CheckpointError(f"corrupt or truncated safetensors file {file}: {exc}") from None

    def _module(self, module: str, handle, dtype: torch.dtype, select: Optional[WeightSelector],
                dequantize_all: bool) -> Iterator[tuple[str, torch.Tensor]]:
        mod = self.modules[module]
        raw = {p: handle(file).get_tensor(f"{module}.{p}") for p, file in mod.parts.items()}
        canonical = convert(module, mod.fmt, mod.scheme, raw)
        del raw
        if mod.dense or dequantize_all:
            name = f"{module}.weight"
            yield name, select_part(dequantize(canonical, mod.scheme, dtype), name, select)
            return
        for part, tensor in canonical.items():
            name = f"{module}.{part}"
            yield name, select_part(tensor, name, select)


def looks_quantized(names) -> Optional[str]:
    """A tensor name that only a quantized checkpoint has (for the error when config.json has no
    quantization_config), or None."""
    return next((n for n in names if n.rpartition(".")[2] in MARKERS | {"weight_zero_point", "qzeros", "g_idx"}), None)
