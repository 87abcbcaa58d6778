"""A checkpoint's ``quantization_config`` (config.json) read into what the converters need.

Four families of HF-style quantized checkpoints are read: compressed-tensors
(llm-compressor's output), AutoAWQ GEMM, GPTQ (AutoGPTQ / GPTQModel, v1 and v2 zero
points) and transformers' fine-grained FP8 (``quant_method: "fp8"``, the official
Qwen3 / DeepSeek FP8 checkpoints). Each is parsed by hand rather than with its
library, so none of them is needed at run time (compressed-tensors' own parser also
refuses the older ``actorder: "group"`` checkpoints this reads). Every field that
changes the arithmetic is either honoured or refused with one ``CheckpointError``
naming it and listing what is supported; fields of calibration only (observers,
damping, dataset...) are left alone.

The result, ``HFQuant``, says per module how the weight is stored (``StoredFormat``);
``hf_quant`` reads the tensors and ``quant_formats`` converts them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Optional

from ingot.loading.errors import CheckpointError

log = logging.getLogger(__name__)

SUPPORTED = (
    "compressed-tensors pack-quantized int4/int8 weights (strategy group/channel/tensor, symmetric or not, "
    "actorder), naive-quantized/int-quantized int8, float-quantized fp8 (strategy tensor/channel/group/block, "
    "activations none or dynamic fp8 per token/group); awq version gemm (4-bit, zero_point, group_size); "
    "gptq bits 4/8 (checkpoint_format gptq or gptq_v2, sym true/false, desc_act); "
    "fp8 (activation_scheme dynamic, weight_block_size [n, k] or null)"
)


def unsupported(what: str) -> CheckpointError:
    return CheckpointError(f"unsupported quantization: {what}. Supported: {SUPPORTED}")


@dataclass(frozen=True)
class StoredFormat:
    """How one module's quantized weight is stored: what its converter needs."""

    kind: str  # ct-packed, ct-int8, ct-fp8, awq, gptq, hf-fp8
    bits: int = 8
    group_size: int = 0  # int: > 0 input columns per scale, -1 one scale per row, 0 one for the tensor
    symmetric: bool = True
    act_order: bool = False  # a g_idx may order the input columns by group
    zero_offset: int = 0  # GPTQ v1: the stored zero point is the real one minus 1
    block: tuple[int, int] = (0, 0)  # fp8: rows and columns per weight scale (0: all)
    act_group: int = -1  # fp8: -1 activations in the model dtype, 0 fp8 per token, g per token and g columns


@dataclass(frozen=True)
class HFQuant:
    """A parsed ``quantization_config``: the stored format of each targeted module."""

    method: str  # compressed-tensors, awq, gptq, fp8
    groups: tuple[tuple[tuple[str, ...], StoredFormat], ...]  # (targets, format); targets as compressed-tensors says
    ignore: tuple[str, ...]  # modules left dense, in QuantConfig's pattern syntax

    def format_for(self, module: str) -> Optional[StoredFormat]:
        """The stored format the config gives ``module`` (HF name), ignoring ``ignore``."""
        for targets, fmt in self.groups:
            if any(_target_matches(t, module) for t in targets):
                return fmt
        return None


def _target_matches(target: str, module: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def parse(qc: Any, source: str = "config.json") -> HFQuant:
    """``quantization_config`` -> HFQuant, or one CheckpointError naming what is not supported."""
    if not isinstance(qc, dict):
        raise unsupported(f"{source} quantization_config is {type(qc).__name__}, not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "fp8":
        return _hf_fp8(qc)
    raise unsupported(f"quant_method={qc.get('quant_method')!r}")


# ---------------------------------------------------------------- compressed-tensors

_CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
_CT_SCHEME_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
_CT_ARGS_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                 "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


def _compressed_tensors(qc: dict) -> HFQuant:
    fmt = qc.get("format")
    if fmt not in (*_CT_FORMATS, "mixed-precision"):
        raise unsupported(f"quant_method='compressed-tensors' format={fmt!r}")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise unsupported(f"quant_method='compressed-tensors' quantization_status={status!r} (weights not compressed)")
    for key in ("kv_cache_scheme", "transform_config", "moe_sparsity_config"):
        if qc.get(key):
            raise unsupported(f"quant_method='compressed-tensors' {key}={qc[key]!r}")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise unsupported(f"quant_method='compressed-tensors' sparsity_config format={sparsity.get('format')!r}")
    groups_in = qc.get("config_groups")
    if not isinstance(groups_in, dict) or not groups_in:
        raise unsupported("quant_method='compressed-tensors' without config_groups")
    groups = []
    for name, scheme in groups_in.items():
        if isinstance(scheme, list):  # a preset name (W4A16, FP8_DYNAMIC...) with its targets
            scheme = _ct_preset(name, scheme)
        groups.append(_ct_group(name, scheme, fmt))
    ignore = tuple(str(p) for p in qc.get("ignore") or ())
    return HFQuant("compressed-tensors", tuple(groups), ignore)


def _ct_preset(name: str, targets: list) -> dict:
    try:
        from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    except ImportError:
        raise CheckpointError(
            f"compressed-tensors config group {name!r} names a preset; install compressed-tensors to read it"
        ) from None
    try:
        return preset_name_to_scheme(name, targets).model_dump()
    except (KeyError, ValueError) as exc:
        raise unsupported(f"compressed-tensors preset scheme {name!r} ({exc})") from None


def _ct_group(name: str, scheme: Any, global_fmt: str) -> tuple[tuple[str, ...], StoredFormat]:
    where = f"quant_method='compressed-tensors' config_groups.{name}"
    if not isinstance(scheme, dict):
        raise unsupported(f"{where} is {scheme!r}")
    extra = set(scheme) - _CT_SCHEME_KEYS
    if extra:
        raise unsupported(f"{where} fields {sorted(extra)}")
    if scheme.get("output_activations"):
        raise unsupported(f"{where}.output_activations={scheme['output_activations']!r}")
    fmt = scheme.get("format") or global_fmt
    if fmt not in _CT_FORMATS:
        raise unsupported(f"{where} format={fmt!r}")
    targets = tuple(str(t) for t in scheme.get("targets") or ())
    for t in targets:
        if t != "Linear" and not t.startswith("re:") and re.fullmatch(r"[A-Z]\w*", t):
            raise unsupported(f"{where}.targets names module class {t!r} (only 'Linear' is)")
    w = _ct_args(scheme.get("weights"), f"{where}.weights")
    if w is None:
        raise unsupported(f"{where} has no weights scheme")
    if w["dynamic"]:
        raise unsupported(f"{where}.weights.dynamic={w['dynamic']!r}")
    act = _ct_args(scheme.get("input_activations"), f"{where}.input_activations")
    if w["type"] == "float":
        return targets, _ct_fp8(w, act, where, fmt)
    return targets, _ct_int(w, act, where, fmt)


def _ct_args(args: Any, where: str) -> Optional[dict]:
    if args is None:
        return None
    if not isinstance(args, dict):
        raise unsupported(f"{where}={args!r}")
    extra = set(args) - _CT_ARGS_KEYS
    if extra:
        raise unsupported(f"{where} fields {sorted(extra)}")
    out = dict(args)
    out["type"] = str(out.get("type", "int")).lower()
    out["num_bits"] = int(out.get("num_bits", 8))
    out["symmetric"] = bool(out.get("symmetric", True))
    out["dynamic"] = out.get("dynamic", False)
    group = out.get("group_size")
    strategy = out.get("strategy")
    if strategy is None:  # compressed-tensors' own inference
        strategy = "tensor" if group is None else "group" if group > 0 else "channel"
    out["strategy"] = str(strategy).lower()
    return out


def _ct_weight_groups(w: dict, where: str) -> int:
    strategy = w["strategy"]
    if strategy == "group":
        if not w.get("group_size") or w["group_size"] <= 0:
            raise unsupported(f"{where}.weights strategy 'group' with group_size={w.get('group_size')!r}")
        return int(w["group_size"])
    if strategy == "channel":
        return -1
    if strategy == "tensor":
        return 0
    raise unsupported(f"{where}.weights.strategy={strategy!r} for {w['type']} weights")


def _ct_int(w: dict, act: Optional[dict], where: str, fmt: str) -> StoredFormat:
    bits = w["num_bits"]
    if fmt == "float-quantized" or (fmt == "pack-quantized" and bits not in (4, 8)) or (fmt != "pack-quantized" and bits != 8):
        raise unsupported(f"{where} int weights of num_bits={bits} in format {fmt!r}")
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "static", "group", "dynamic"):
        raise unsupported(f"{where}.weights.actorder={actorder!r}")
    if act is not None:
        if act["type"] != "int" or not act["dynamic"]:
            raise unsupported(f"{where}.input_activations {act['type']} dynamic={act['dynamic']!r} with int weights")
        log.warning("%s: int activation quantization is not applied; activations stay in the model dtype", where)
    group_size = _ct_weight_groups(w, where)
    if group_size == 0 and not w["symmetric"]:
        raise unsupported(f"{where}.weights strategy 'tensor' with symmetric=False")
    return StoredFormat(
        kind="ct-packed" if fmt == "pack-quantized" else "ct-int8",
        bits=bits,
        group_size=group_size,
        symmetric=w["symmetric"],
        act_order=actorder in ("group", "dynamic"),
    )


def _ct_fp8(w: dict, act: Optional[dict], where: str, fmt: str) -> StoredFormat:
    if w["num_bits"] != 8 or fmt not in ("float-quantized", "naive-quantized"):
        raise unsupported(f"{where} float weights of num_bits={w['num_bits']} in format {fmt!r} (only fp8 e4m3)")
    if not w["symmetric"]:
        raise unsupported(f"{where}.weights fp8 with symmetric=False")
    strategy = w["strategy"]
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2):
            raise unsupported(f"{where}.weights.block_structure={bs!r}")
        block = (int(bs[0]), int(bs[1]))
    else:
        groups = _ct_weight_groups(w, where)
        block = (0, 0) if groups == 0 else (1, 0) if groups == -1 else (1, groups)
    act_group = -1
    if act is not None:
        if act["type"] != "float" or act["num_bits"] != 8 or not act["symmetric"]:
            raise unsupported(f"{where}.input_activations type={act['type']} num_bits={act['num_bits']} with fp8 weights")
        if act["dynamic"] is not True:
            raise unsupported(f"{where}.input_activations dynamic={act['dynamic']!r} (static activation scales)")
        if act["strategy"] == "token":
            act_group = 0
        elif act["strategy"] == "group" and act.get("group_size", 0) > 0:
            act_group = int(act["group_size"])
        else:
            raise unsupported(f"{where}.input_activations dynamic strategy={act['strategy']!r} (token or group only)")
    return StoredFormat(kind="ct-fp8", block=block, act_group=act_group)


# ---------------------------------------------------------------- AutoAWQ, GPTQ


def _int_field(qc: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if qc.get(k) is not None:
            return qc[k]
    return default


def _transformers_ignore(patterns: Any) -> tuple[str, ...]:
    """transformers' modules_to_not_convert (a regex from the start up to a module boundary,
    or a suffix) in QuantConfig's ``re:`` syntax."""
    out = []
    for p in patterns or ():
        out.append(f"re:(?:{p})(?:(?<=\\.)|(?=\\.|$))")
        out.append(f"re:.*{re.escape(p)}$")
    return tuple(out)


def _awq(qc: dict) -> HFQuant:
    version = str(_int_field(qc, "version", "format", default="gemm")).lower()
    if version != "gemm":
        raise unsupported(f"quant_method='awq' version={version!r}")
    bits = int(_int_field(qc, "bits", "w_bit", default=4))
    if bits != 4:
        raise unsupported(f"quant_method='awq' bits={bits}")
    if not _int_field(qc, "zero_point", default=True):
        raise unsupported("quant_method='awq' zero_point=False")
    group = int(_int_field(qc, "group_size", "q_group_size", default=128))
    if group == 0 or group < -1:
        raise unsupported(f"quant_method='awq' group_size={group}")
    fmt = StoredFormat(kind="awq", bits=4, group_size=group, symmetric=False)
    return HFQuant("awq", ((("Linear",), fmt),), _transformers_ignore(qc.get("modules_to_not_convert")))


_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}


def _gptq(qc: dict) -> HFQuant:
    if qc.get("is_marlin_format"):
        raise unsupported("quant_method='gptq' is_marlin_format=True")
    fmt = str(_int_field(qc, "checkpoint_format", "format", default="gptq")).lower()
    if fmt not in _GPTQ_FORMATS:
        raise unsupported(f"quant_method='gptq' checkpoint_format={fmt!r}")
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise unsupported(f"quant_method='gptq' bits={bits}")
    pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise unsupported(f"quant_method='gptq' pack_dtype={qc['pack_dtype']!r}")
    for key in ("dynamic", "adapter"):
        if qc.get(key):
            raise unsupported(f"quant_method='gptq' {key}={qc[key]!r}")
    group = int(qc.get("group_size", 128))
    if group == 0 or group < -1:
        raise unsupported(f"quant_method='gptq' group_size={group}")
    desc_act = bool(qc.get("desc_act", False)) and not bool(qc.get("static_groups", False))
    stored = StoredFormat(kind="gptq", bits=bits, group_size=group, symmetric=bool(qc.get("sym", True)),
                          act_order=desc_act, zero_offset=_GPTQ_FORMATS[fmt])
    return HFQuant("gptq", ((("Linear",), stored),), ())


# ---------------------------------------------------------------- transformers' fine-grained FP8

_FP8_KEYS = {"quant_method", "activation_scheme", "weight_block_size", "fmt", "modules_to_not_convert",
             "ignored_layers", "dequantize", "scale_fmt", "expert_dtype", "modules_to_convert"}


def _hf_fp8(qc: dict) -> HFQuant:
    extra = set(qc) - _FP8_KEYS
    if extra:
        raise unsupported(f"quant_method='fp8' fields {sorted(extra)}")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise unsupported(f"quant_method='fp8' activation_scheme={scheme!r}")
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        raise unsupported(f"quant_method='fp8' fmt={qc['fmt']!r}")
    if qc.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise unsupported(f"quant_method='fp8' scale_fmt={qc['scale_fmt']!r}")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise unsupported(f"quant_method='fp8' expert_dtype={qc['expert_dtype']!r}")
    if qc.get("modules_to_convert"):
        raise unsupported(f"quant_method='fp8' modules_to_convert={qc['modules_to_convert']!r}")
    bs = qc["weight_block_size"] if "weight_block_size" in qc else [128, 128]  # transformers' default
    if bs is None:
        block, act_group = (0, 0), 0
    elif isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs):
        block, act_group = (int(bs[0]), int(bs[1])), int(bs[1])
    else:
        raise unsupported(f"quant_method='fp8' weight_block_size={bs!r}")
    fmt = StoredFormat(kind="hf-fp8", block=block, act_group=act_group)
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers")
    return HFQuant("fp8", ((("Linear",), fmt),), _transformers_ignore(ignore))
