"""The GGUF container: header, metadata, tensor table and one-tensor reads.

Knows the file layout only, nothing of llama.cpp's names or of tokenizers, so
the same reads serve the HF-style mapping (``gguf.py``) and code that wants a
tensor's quantized blocks as stored (``read_raw_blocks``) rather than floats.

The header is parsed here with ``struct`` rather than ``gguf.GGUFReader``: that
reader makes a numpy view per array item and needs ~5 s for the 49k-token
vocabulary of SmolLM2 (the default model); this parser needs ~0.2 s. The tensor
data stays memory-mapped and is read one tensor at a time.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf.constants import GGMLQuantizationType as QT
from gguf.constants import GGUFValueType as VT
from gguf.quants import dequantize

from ingot.loading.errors import CheckpointError

# Types whose dequantization gguf-py implements and our tests check.
SUPPORTED_QUANT_TYPES = frozenset(
    {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4}
)
# Float types torch reads straight from the file, skipping a float32 detour.
_TORCH_FLOATS = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}


class GGUFFormatError(Exception):
    """The bytes do not follow the GGUF layout (the caller turns it into a CheckpointError naming the file)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file and how it is stored; enough to read it without the header."""

    name: str  # llama.cpp's name, e.g. blk.0.attn_q.weight
    shape: tuple[int, ...]  # HF (numpy) order: GGUF's ne order reversed
    qtype: QT
    offset: int  # absolute byte offset in the file (GGUF's own offset is relative to the data section)
    nbytes: int

    @property
    def raw_shape(self) -> tuple[int, ...]:
        """Shape of the stored bytes: the leading dims, then the bytes of one row of quant blocks."""
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * type_size)


def map_file(path: Path) -> mmap.mmap:
    """The whole file memory-mapped, after the checks that give a missing or empty file a clear error."""
    if not path.is_file():
        raise CheckpointError(f"no such file: {path}" if not path.exists() else f"{path} is not a file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty, not a GGUF file")
    try:
        with open(path, "rb") as f:
            # Copy-on-write: a writable private mapping, so numpy/torch views do not warn; never written.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


_SCALAR_FORMATS = {
    VT.UINT8: "<B",
    VT.INT8: "<b",
    VT.UINT16: "<H",
    VT.INT16: "<h",
    VT.UINT32: "<I",
    VT.INT32: "<i",
    VT.FLOAT32: "<f",
    VT.BOOL: "<?",
    VT.UINT64: "<Q",
    VT.INT64: "<q",
    VT.FLOAT64: "<d",
}


class _Cursor:
    """Sequential little-endian reads from the mapped file, bounds-checked."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise GGUFFormatError(f"truncated: needs {self.pos} bytes, the file has {len(self.buf)}")
        return start

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == VT.STRING:
            return self.string()
        if vtype == VT.ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _SCALAR_FORMATS:  # numeric arrays in one numpy read
                dtype = np.dtype(_SCALAR_FORMATS[VT(itype)])
                start = self.take(count * dtype.itemsize)
                return np.frombuffer(self.buf, dtype, count, start).tolist()
            return [self.value(itype) for _ in range(count)]
        if vtype not in _SCALAR_FORMATS:
            raise GGUFFormatError(f"unknown metadata value type {vtype} at byte {self.pos}")
        value = self.scalar(_SCALAR_FORMATS[VT(vtype)])
        # float32 scalars (eps, rope base) as their shortest decimal: 1e-05, not 9.99999974e-06
        return float(str(np.float32(value))) if vtype == VT.FLOAT32 else value


def read_header(buf: mmap.mmap) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Header, metadata and tensor table (GGUF v2/v3, little-endian)."""
    cur = _Cursor(buf)
    if len(buf) < 4 or cur.scalar("<I") != GGUF_MAGIC:
        raise GGUFFormatError("bad magic (the file does not start with 'GGUF')")
    version = cur.scalar("<I")
    if version not in (2, 3):
        detail = "a big-endian file" if version & 0xFFFF == 0 else f"version {version}"
        raise GGUFFormatError(f"{detail} is not supported (GGUF v2/v3 little-endian only)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    raw = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        if not 1 <= n_dims <= 4:
            raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
        ne = [cur.scalar("<Q") for _ in range(n_dims)]
        raw.append((name, ne, cur.scalar("<I"), cur.scalar("<Q")))
    align = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0:
        raise GGUFFormatError(f"bad general.alignment {align!r}")
    data_start = -(-cur.pos // align) * align
    tensors = []
    for name, ne, type_id, offset in raw:
        try:
            qtype = QT(type_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown ggml type id {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
            raise GGUFFormatError(f"tensor {name!r}: row length {ne[0]} is not a multiple of the {qtype.name} block {block}")
        nbytes = math.prod(ne) // block * type_size
        start = data_start + offset
        if start + nbytes > len(buf):
            raise GGUFFormatError(
                f"truncated: tensor {name!r} needs bytes up to {start + nbytes}, the file has {len(buf)}"
            )
        tensors.append(TensorInfo(name, tuple(reversed(ne)), qtype, start, nbytes))
    return meta, tensors


def check_supported(info: TensorInfo) -> None:
    """Refuse, before any weight is read, a tensor whose type ``read_tensor`` cannot dequantize."""
    if info.qtype not in SUPPORTED_QUANT_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_QUANT_TYPES))
        raise CheckpointError(
            f"tensor {info.name!r} is quantized as {info.qtype.name}, which ingot cannot dequantize "
            f"(supported: {names}); use a GGUF with a supported quantization"
        )


def read_tensor(buf: mmap.mmap, info: TensorInfo) -> torch.Tensor:
    """One tensor as a fresh torch tensor: floats as stored, quantized types as float32."""
    if info.qtype in _TORCH_FLOATS:
        dtype = _TORCH_FLOATS[info.qtype]
        flat = torch.frombuffer(buf, dtype=dtype, count=math.prod(info.shape), offset=info.offset)
        return flat.reshape(info.shape).clone()  # clone: do not hand out views of the mapping
    rows = np.frombuffer(buf, np.uint8, info.nbytes, info.offset).reshape(*info.shape[:-1], -1)
    return torch.from_numpy(dequantize(rows, info.qtype))


def read_raw_blocks(buf: mmap.mmap, info: TensorInfo) -> torch.Tensor:
    """One tensor's bytes as stored, ``uint8`` of ``info.raw_shape``, not dequantized.

    For kernels that consume ggml blocks (Q8_0, Q4_K, ...) directly; a copy, like
    ``read_tensor``, so no view of the mapping outlives it.
    """
    if not info.nbytes:  # torch.frombuffer refuses a count of 0
        return torch.empty(info.raw_shape, dtype=torch.uint8)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
    return flat.reshape(info.raw_shape).clone()
