"""Tiny quantized checkpoints for the tests/loading/test_quant_*.py files.

compressed-tensors checkpoints are made by the library itself from a tiny random
transformers Llama (scales computed here from each weight's range, then
``ModelCompressor`` compresses and the model saves); AutoAWQ and GPTQ checkpoints
are packed here following those projects' documented layouts; ``ref_*`` are
reference dequantizations written from the same documentation, element by element
where that is short, independent of ingot's converters.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import save_file

from tests.helpers import write_tokenizer as _train_tokenizer

_TOKENIZER: dict[str, bytes] = {}


def write_tokenizer(path: Path) -> None:
    """tests.helpers' tiny tokenizer, trained once per session and copied."""
    if not _TOKENIZER:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            _train_tokenizer(Path(tmp))
            _TOKENIZER.update({f.name: f.read_bytes() for f in Path(tmp).iterdir()})
    for name, data in _TOKENIZER.items():
        (path / name).write_bytes(data)

LLAMA = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def llama_config(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16", **LLAMA, **extra}


def tiny_llama(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**LLAMA)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


# ---------------------------------------------------------------- compressed-tensors


def _amax_regions(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of each region one scale covers, for args.strategy."""
    n, k = w.shape
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        g = w.reshape(n, k // args.group_size, args.group_size)
        return g.amin(-1), g.amax(-1)
    bn, bk = args.block_structure
    b = w.reshape(n // bn, bn, k // bk, bk)
    return b.amin((1, 3)), b.amax((1, 3))


def calibrate(module: torch.nn.Module, args) -> None:
    """Min-max scales (and zero points) for module.weight, as llm-compressor's observer sets them."""
    lo, hi = _amax_regions(module.weight.detach().float(), args)
    if args.type == "float":
        scale = torch.maximum(lo.abs(), hi).clamp(min=1e-8) / torch.finfo(torch.float8_e4m3fn).max
        zp = None
    else:
        qmin, qmax = -(2 ** (args.num_bits - 1)), 2 ** (args.num_bits - 1) - 1
        if args.symmetric:
            scale = torch.maximum(lo.abs(), hi).clamp(min=1e-8) / ((qmax - qmin) / 2)
            zp = torch.zeros_like(scale)
        else:
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
            scale = ((hi - lo) / (qmax - qmin)).clamp(min=1e-8)
            zp = (qmin - lo / scale).round().clamp(qmin, qmax)
    module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape))
    if zp is not None and hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zp.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape))


def ct_checkpoint(path: Path, weights: dict, fmt: str, input_activations: Optional[dict] = None,
                  ignore: tuple[str, ...] = ("lm_head",), seed: int = 0) -> Path:
    """A compressed-tensors checkpoint of a tiny Llama, every Linear but ``ignore`` quantized."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    model = tiny_llama(seed)
    acts = QuantizationArgs(**input_activations) if input_activations else None
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights), input_activations=acts)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore), quantization_status="frozen")
    apply_quantization_config(model, qc, show_progress=False)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            calibrate(module, module.quantization_scheme.weights)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    write_tokenizer(path)
    return path


def hf_dequantized(path: Path) -> dict[str, torch.Tensor]:
    """transformers' own load of a quantized checkpoint, dequantized: module name -> dense weight."""
    import warnings

    import transformers

    with warnings.catch_warnings():  # "the quantization_config from the model will be used": as meant
        warnings.simplefilter("ignore", UserWarning)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, quantization_config=_dequantize_config(path))
    return {name: m.weight.detach() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _dequantize_config(path: Path):
    from transformers.utils.quantization_config import CompressedTensorsConfig, FineGrainedFP8Config

    method = json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]
    return CompressedTensorsConfig(dequantize=True) if method == "compressed-tensors" else FineGrainedFP8Config(dequantize=True)


# ---------------------------------------------------------------- AutoAWQ / GPTQ packing


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble i of a word holds column 8c + AWQ_ORDER[i]


def pack_rows_along_last(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[R, C] unsigned -> int32 [R, C * bits / 32]: word c takes columns c*p .. c*p+p-1, value i at bits*i."""
    p = 32 // bits
    r, c = values.shape
    order = order or tuple(range(p))
    words = np.zeros((r, c // p), dtype=np.uint32)
    for col in range(c // p):
        for i in range(p):
            words[:, col] |= values[:, col * p + order[i]].astype(np.uint32) << np.uint32(bits * i)
    return words.view(np.int32)


def awq_module(w_q: np.ndarray, zeros: np.ndarray, scales: np.ndarray) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors for unsigned 4-bit values w_q [N, K], zeros [N, G], scales [N, G] (fp16)."""
    return {
        "qweight": torch.from_numpy(pack_rows_along_last(w_q.T.copy(), 4, AWQ_ORDER)),
        "qzeros": torch.from_numpy(pack_rows_along_last(zeros.T.copy(), 4, AWQ_ORDER)),
        "scales": torch.from_numpy(scales.T.copy()),
    }


def gptq_module(w_q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, bits: int, v1: bool,
                g_idx: Optional[np.ndarray] = None) -> dict[str, torch.Tensor]:
    """GPTQ tensors for unsigned values w_q [N, K], zero points [N, G], scales [N, G]:
    qweight packed along K ([K * bits / 32, N]), qzeros along N, v1 storing z - 1 (the
    whole words minus 0x11111111, as GPTQModel converts v2 to v1)."""
    qweight = pack_rows_along_last(w_q, bits).T.copy()  # pack along K, then [K/p, N]
    qzeros = pack_rows_along_last(zeros.T.copy(), bits).view(np.uint32).astype(np.int64)
    if v1:
        qzeros = (qzeros - (0x11111111 if bits == 4 else 0x01010101)) % 2**32
    out = {
        "qweight": torch.from_numpy(qweight),
        "qzeros": torch.from_numpy(qzeros.astype(np.uint32).view(np.int32)),
        "scales": torch.from_numpy(scales.T.copy()),
    }
    k = w_q.shape[1]
    out["g_idx"] = torch.from_numpy(g_idx if g_idx is not None else np.arange(k) // (k // scales.shape[1])).to(torch.int32)
    return out


def ref_int(w_q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> torch.Tensor:
    """W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], element by element in fp32, rounded once to bf16."""
    n, k = w_q.shape
    out = np.empty((n, k), dtype=np.float32)
    s = scales.astype(np.float32)
    for col in range(k):
        g = g_idx[col]
        out[:, col] = (w_q[:, col].astype(np.float32) - zeros[:, g].astype(np.float32)) * s[:, g]
    return torch.from_numpy(out).to(torch.bfloat16)


def write_hf_dir(path: Path, tensors: dict[str, torch.Tensor], quantization_config: Optional[dict],
                 config: Optional[dict] = None, shards: int = 1) -> Path:
    """config.json (+ quantization_config), the tensors in ``shards`` safetensors files, a tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = config or llama_config()
    if quantization_config is not None:
        cfg = {**cfg, "quantization_config": quantization_config}
    (path / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({n: tensors[n].contiguous() for n in part}, str(path / file))
            weight_map.update({n: file for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    write_tokenizer(path)
    return path


@functools.lru_cache(maxsize=4)
def _state_dict(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_llama(seed).state_dict().items()}


def dense_tensors(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The state dict of the tiny Llama (bf16), to keep dense or quantize."""
    return {k: v.to(dtype) for k, v in _state_dict(seed).items()}


def fp8_blocks(w: torch.Tensor, block: Optional[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fine-grained FP8 of a dense weight: fp8 values and fp32 weight_scale_inv
    (per [bn, bk] block, or one scalar with block None), each block's max at 448."""
    n, k = w.shape
    bn, bk = block or (n, k)
    blocks = w.float().reshape(n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax((1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(n, k)
    return q, (scale if block else scale.reshape(()))
