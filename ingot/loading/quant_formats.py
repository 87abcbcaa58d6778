"""One module's quantized tensors, as a format stores them, -> the canonical form.

``plan`` decides a module's canonical scheme from the shapes alone (at open, before
any weight is read), ``convert`` turns its tensors into the canonical ones. The
layouts (what ``quant_scheme`` calls canonical: int values packed along K, little-endian,
unsigned; fp8 with an fp32 scale per block):

* compressed-tensors ``pack-quantized``: ``weight_packed`` int32 [N, K * bits / 32] holds
  ``q + 2 ** (bits - 1)`` in the canonical order already; asymmetric zero points
  ``weight_zero_point`` are packed the same way but along dim 0 ([N * bits / 32, G]),
  their raw unsigned values being the canonical zero points; ``weight_g_idx`` (actorder
  ``group``) maps each input column to its group;
* compressed-tensors ``naive`` / ``int-quantized``: int8 ``weight`` [N, K] (+128) and int8 zero points;
* compressed-tensors ``float-quantized`` and transformers' ``fp8``: fp8 ``weight`` [N, K] and
  ``weight_scale`` / ``weight_scale_inv`` (a multiplier despite the name) per tensor,
  row, group or block;
* AutoAWQ GEMM: ``qweight`` int32 [K, N / 8] packed along N in the order 0 2 4 6 1 3 5 7,
  ``qzeros`` [K / G, N / 8] alike, ``scales`` [K / G, N]: W = (q - z) * s, q and z unsigned;
* GPTQ: ``qweight`` int32 [K * bits / 32, N] packed along K (the canonical order, transposed),
  ``qzeros`` [K / G, N * bits / 32] packed along N, ``scales`` [K / G, N], ``g_idx`` [K];
  v1 checkpoints store z - 1 (GPTQModel adds 1 to each packed word as a whole, so a zero
  point of 0 stored as -1 comes back), v2 store z. With ``desc_act`` the input columns are
  sorted by group (stable) so that groups are contiguous and ``perm`` says where each came from.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ingot.loading.errors import CheckpointError
from ingot.loading.quant_config import StoredFormat
from ingot.loading.quant_pack import pack_int, unpack_int
from ingot.loading.quant_scheme import Fp8Weights, IntWeights, LinearScheme

# the tensors of one module per stored kind: (required, optional)
PARTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "ct-packed": (frozenset({"weight_packed", "weight_scale"}),
                  frozenset({"weight_shape", "weight_zero_point", "weight_g_idx"})),
    "ct-int8": (frozenset({"weight", "weight_scale"}), frozenset({"weight_zero_point", "weight_g_idx"})),
    "ct-fp8": (frozenset({"weight", "weight_scale"}), frozenset()),
    "awq": (frozenset({"qweight", "qzeros", "scales"}), frozenset()),
    "gptq": (frozenset({"qweight", "scales"}), frozenset({"qzeros", "g_idx"})),
    "hf-fp8": (frozenset({"weight", "weight_scale_inv"}), frozenset()),
}
# a module is stored quantized when it has one of these
MARKERS = frozenset({"weight_packed", "weight_scale", "qweight", "weight_scale_inv"})
# quantization tensors of schemes ingot does not run (static activation scales, kv cache, nvfp4)
REFUSED_PARTS = frozenset({"input_scale", "output_scale", "k_scale", "v_scale", "q_scale", "activation_scale",
                           "weight_global_scale", "input_global_scale", "input_zero_point", "output_zero_point"})

_AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 lies in nibble _AWQ_REVERSE[j]
_FP8_DTYPES = (torch.float8_e4m3fn,)


def plan(module: str, fmt: StoredFormat, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> LinearScheme:
    """The canonical scheme of ``module`` stored as ``fmt`` with these tensors (part -> shape, dtype)."""
    required, optional = PARTS[fmt.kind]
    missing = required - set(shapes)
    extra = set(shapes) - required - optional
    if missing or extra:
        what = f"missing {sorted(missing)}" if missing else f"unexpected {sorted(extra)}"
        raise CheckpointError(f"{module}: {fmt.kind} tensors {what} (has {sorted(shapes)})")
    marker = next(p for p in ("weight_packed", "qweight", "weight") if p in shapes)
    shape, dtype = shapes[marker]
    if len(shape) != 2:
        raise CheckpointError(
            f"{module}.{marker} has shape {list(shape)}: stacked (fused) expert tensors are not supported yet; "
            "per-expert modules (mlp.experts.E.gate_proj) are"
        )
    if fmt.kind in ("ct-fp8", "hf-fp8"):
        if dtype not in _FP8_DTYPES:
            raise CheckpointError(f"{module}.weight is {dtype}, expected float8_e4m3fn for {fmt.kind}")
        return Fp8Weights(block_n=fmt.block[0], block_k=fmt.block[1], act_group=fmt.act_group)
    if fmt.kind == "ct-int8" and dtype != torch.int8:
        raise CheckpointError(f"{module}.weight is {dtype}, expected int8 for compressed-tensors int8")
    if dtype != torch.int32 and fmt.kind != "ct-int8":
        raise CheckpointError(f"{module}.{marker} is {dtype}, expected int32")
    pack = 32 // fmt.bits
    k = {"ct-packed": shape[1] * pack, "ct-int8": shape[1], "awq": shape[0], "gptq": shape[0] * pack}[fmt.kind]
    group = fmt.group_size if fmt.group_size > 0 else k
    if k % group:
        raise CheckpointError(f"{module}: {k} input features are not a multiple of group_size {group}")
    if fmt.kind == "ct-packed" and not fmt.symmetric and "weight_zero_point" not in shapes:
        raise CheckpointError(f"{module}: asymmetric compressed-tensors weights without weight_zero_point")
    if fmt.kind == "gptq" and not fmt.symmetric and "qzeros" not in shapes:
        raise CheckpointError(f"{module}: asymmetric GPTQ weights without qzeros")
    if fmt.kind == "gptq" and fmt.act_order and "g_idx" not in shapes:
        raise CheckpointError(f"{module}: desc_act GPTQ weights without g_idx")
    act_order = fmt.act_order and ("g_idx" in shapes or "weight_g_idx" in shapes)
    return IntWeights(bits=fmt.bits, group_size=group, has_zeros=not fmt.symmetric, act_order=act_order)


def convert(module: str, fmt: StoredFormat, scheme: LinearScheme,
            t: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The canonical tensors (qweight, scales, ... or weight, weight_scale) of one module."""
    if isinstance(scheme, Fp8Weights):
        return _fp8(module, scheme, t["weight"], t["weight_scale" if fmt.kind == "ct-fp8" else "weight_scale_inv"])
    if fmt.kind == "ct-packed":
        out = _ct_packed(module, fmt, t)
    elif fmt.kind == "ct-int8":
        out = _ct_int8(t, fmt)
    elif fmt.kind == "awq":
        out = _awq(t)
    else:
        out = _gptq(module, fmt, t)
    n, k = out["qweight"].shape[0], out["qweight"].shape[1] * (32 // fmt.bits)
    out["scales"] = _scales(module, out["scales"], n, k // scheme.group_size)
    g_idx = t.get("g_idx", t.get("weight_g_idx"))
    if g_idx is not None:
        _apply_g_idx(module, scheme, out, g_idx, k)
    if not scheme.has_zeros:
        out.pop("zeros", None)
    return out


def _scales(module: str, scales: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    if scales.numel() == 1:  # strategy "tensor": one scale for every row
        return scales.reshape(1, 1).expand(n, 1).contiguous()
    if tuple(scales.shape) != (n, groups):
        raise CheckpointError(f"{module}: scales of shape {list(scales.shape)}, expected [{n}, {groups}]")
    return scales.contiguous()


def _fp8(module: str, scheme: Fp8Weights, weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = weight.shape
    grid = scheme.grid(n, k)
    if scale.numel() != grid[0] * grid[1]:
        raise CheckpointError(f"{module}: fp8 weight scale of shape {list(scale.shape)}, expected {list(grid)} "
                              f"for blocks of {scheme.block_n or n} x {scheme.block_k or k}")
    return {"weight": weight.contiguous(), "weight_scale": scale.float().reshape(grid).contiguous()}


def _ct_packed(module: str, fmt: StoredFormat, t: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    qweight = t["weight_packed"].contiguous()
    n, k = qweight.shape[0], qweight.shape[1] * (32 // fmt.bits)
    if "weight_shape" in t and [int(v) for v in t["weight_shape"]] != [n, k]:
        raise CheckpointError(f"{module}: weight_shape {t['weight_shape'].tolist()} is not [{n}, {k}] "
                              f"(input features not a multiple of {32 // fmt.bits} are not supported)")
    out = {"qweight": qweight, "scales": t["weight_scale"]}
    if "weight_zero_point" in t:  # packed along dim 0: raw unsigned values = the canonical zero points
        zp = t["weight_zero_point"]
        out["zeros"] = unpack_int(zp.t().contiguous(), fmt.bits)[:, :n].t().contiguous()
    return out


def _ct_int8(t: Mapping[str, torch.Tensor], fmt: StoredFormat) -> dict[str, torch.Tensor]:
    u = t["weight"].view(torch.uint8) ^ 0x80  # q + 128
    out = {"qweight": pack_int(u, 8), "scales": t["weight_scale"]}
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"].to(torch.int16) + 128
        out["zeros"] = zp.to(torch.uint8).reshape(u.shape[0], -1)
    return out


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, N / 8] -> the unsigned 4-bit values [R, N] in column order."""
    u = unpack_int(words, 4)
    r, n = u.shape
    return u.reshape(r, n // 8, 8)[:, :, list(_AWQ_REVERSE)].reshape(r, n)


def _awq(t: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    u = _awq_columns(t["qweight"])  # [K, N]
    return {
        "qweight": pack_int(u.t(), 4),
        "scales": t["scales"].t(),
        "zeros": _awq_columns(t["qzeros"]).t().contiguous(),
    }


_GPTQ_V1_ONES = {4: 0x11111111, 8: 0x01010101}


def _gptq(module: str, fmt: StoredFormat, t: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    qweight = t["qweight"].t().contiguous()  # [N, K * bits / 32], the canonical packing
    n = qweight.shape[0]
    scales = t["scales"].t()
    out = {"qweight": qweight, "scales": scales}
    if "qzeros" in t:
        qzeros = t["qzeros"]
        if fmt.zero_offset:  # v1: add 1 to every packed zero point, word-wise as GPTQModel does
            words = (qzeros.to(torch.int64) + _GPTQ_V1_ONES[fmt.bits]) & 0xFFFFFFFF
            qzeros = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        zeros = unpack_int(qzeros.contiguous(), fmt.bits)[:, :n].t().contiguous()
        if fmt.symmetric:
            default = 2 ** (fmt.bits - 1)
            if not bool((zeros == default).all()):
                found = sorted(set(zeros.unique().tolist()))[:8]
                raise CheckpointError(
                    f"{module}: sym=True GPTQ weights with zero points {found}, not all {default} "
                    "(a gptq_v2 checkpoint labelled v1, or the reverse?)"
                )
        out["zeros"] = zeros
    return out


def _apply_g_idx(module: str, scheme: IntWeights, out: dict[str, torch.Tensor], g_idx: torch.Tensor, k: int) -> None:
    """Check a g_idx against the groups; with act_order, sort the columns by group and add ``perm``."""
    g_idx = g_idx.to(torch.int64).reshape(-1)
    if g_idx.numel() != k:
        raise CheckpointError(f"{module}: g_idx has {g_idx.numel()} entries for {k} input features")
    contiguous = torch.arange(k) // scheme.group_size
    if not scheme.act_order:
        if not torch.equal(g_idx, contiguous):
            raise CheckpointError(f"{module}: g_idx orders the input columns, but the config has no act order "
                                  "(desc_act / actorder group)")
        return
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], contiguous):
        raise CheckpointError(f"{module}: g_idx does not give every group {scheme.group_size} columns")
    u = unpack_int(out["qweight"], scheme.bits)[:, perm]
    out["qweight"] = pack_int(u, scheme.bits)
    out["perm"] = perm
