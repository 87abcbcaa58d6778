"""EngineConfig: every knob of the engine in one dataclass.

Each field can be overridden by an ``INGOT_<FIELD>`` environment variable
(``INGOT_DECODE_COMPILE=1``, ``INGOT_MAX_NUM_SEQS=64`` ...). The variables are
parsed here and nowhere else; a bad value raises ``ConfigError`` naming the
variable. Precedence: defaults < environment < explicit arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

ENV_PREFIX = "INGOT_"

# Ops that have both a kernel and a PyTorch form Inductor can fuse.
FUSIBLE_OPS = ("rms_norm", "rotary", "silu_and_mul", "gelu_tanh_and_mul")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")
# online quantization of a dense model, then the methods of quantized checkpoints (which must match the file)
QUANTIZATIONS = ("fp8", "int8", "int4", "awq", "gptq", "compressed-tensors", "gguf")
# how a thinking model marks its reasoning (<think>...</think>): where a reply starts (engine/reasoning.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ConfigError(ValueError):
    """A configuration value (argument or INGOT_* variable) is invalid; ``field`` names it."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# methods whose proposer is a model beside the target (its own KV cache, runner/draft_runner.py)
DRAFT_METHODS = ("draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
_NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` fields): each decode step a sequence
    proposes up to ``num_speculative_tokens`` tokens and one forward verifies them all.

    ``ngram``: the proposals are the tokens that followed the latest ``prompt_lookup_min`` ..
    ``prompt_lookup_max`` tokens where they occurred earlier in the request's own prompt and
    output (prompt lookup). ``draft_model`` (implied by ``model``): a smaller model with the
    same vocabulary proposes them greedily (``model``: an HF directory, .gguf file, hub id or
    built-in shape name; ``quantization`` as ``EngineConfig.quantization``, for the draft).
    ``disable_by_batch_size``: no sequence proposes while more than this many run (a large
    batch is compute-bound: verifying drafts costs more than it saves).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 32
    model: Optional[str] = None
    draft_tensor_parallel_size: int = 1  # (vLLM's field; the draft runs on the target's one device)
    quantization: Optional[str] = None

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> "SpeculativeConfig":
        """Validate vLLM's dict form; ``ConfigError`` (field ``speculative_config``) naming what is wrong.
        A lone ``prompt_lookup_min`` or ``prompt_lookup_max`` sets both (vLLM's rule); a ``model``
        without a ``method`` is ``draft_model`` (vLLM infers it too)."""
        if not isinstance(spec, Mapping):
            raise spec_error(f"must be a dict (or JSON object), got {type(spec).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - names)
        if unknown:
            raise spec_error(f"unknown field(s) {unknown}; known: {sorted(names)}")
        values = {k: v for k, v in spec.items() if v is not None}
        if "model" in values and "method" not in values:
            values["method"] = "draft_model"
        missing = [name for name in ("method", "num_speculative_tokens") if name not in values]
        if missing:
            raise spec_error(f"missing field(s) {missing}")
        if values["method"] in DRAFT_METHODS:
            lookup = [name for name in _NGRAM_FIELDS if name in values]
            if lookup:
                raise spec_error(f"{lookup} apply to method 'ngram', not to {values['method']!r}")
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if lo is None and hi is not None:
            values["prompt_lookup_min"] = hi
        elif hi is None and lo is not None:
            values["prompt_lookup_max"] = lo
        return cls(**values)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise spec_error(f"method must be one of {SPEC_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise spec_error(f"{name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise spec_error(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                              f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise spec_error(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise spec_error(f"method 'draft_model' needs 'model' (the draft: an HF directory, .gguf file, "
                                  f"hub id or built-in shape), got {self.model!r}")
        elif self.method in DRAFT_METHODS:
            if not isinstance(self.model, str) or not self.model:
                raise spec_error(f"method {self.method!r} needs 'model' (the head's directory or hub id), "
                                  f"got {self.model!r}")
            if self.quantization is not None:
                raise spec_error(f"quantization applies to a draft model, not to an {self.method!r} head")
        elif self.model is not None or self.quantization is not None:
            raise spec_error(f"'model' and 'quantization' name a draft model: method must be 'draft_model' "
                              f"(or left out), got {self.method!r}")
        if self.draft_tensor_parallel_size != 1:
            raise spec_error(f"draft_tensor_parallel_size must be 1 (the draft model runs whole on the target's "
                             f"device, the driver's under tensor parallelism), got {self.draft_tensor_parallel_size!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise spec_error(f"quantization must be one of {QUANTIZATIONS} (or None), got {self.quantization!r}")

    @property
    def uses_draft_model(self) -> bool:
        """A model beside the target proposes (a draft model or an EAGLE head)."""
        return self.method in DRAFT_METHODS

    @property
    def uses_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3")


def spec_error(message: str) -> ConfigError:
    """A ``ConfigError`` of the ``speculative_config`` field."""
    return ConfigError(f"speculative_config: {message}", "speculative_config")


@dataclass
class EngineConfig:
    """How the engine loads the model, sizes its KV cache, schedules and runs."""

    model: Optional[str] = None  # HF dir, hub id, .gguf file; None = default SmolLM2; with load_format dummy also a built-in shape
    tokenizer: Optional[str] = None  # defaults to the model's own; "default" = the default model's
    # "auto": the checkpoint's weights; "dummy": its configuration with seeded random weights
    # (vLLM's name), for measuring a model's speed without its weights (loading/dummy.py)
    load_format: str = "auto"
    # fp8 / int8 / int4: a dense checkpoint's linear layers quantized at load (W8A8 fp8 with a scale
    # per tensor, int8 per channel, int4 in groups of 128; docs/quantization.md); a quantized
    # checkpoint is served in its own format (its quant_method may be named here: it must match)
    quantization: Optional[str] = None
    dtype: str = "auto"  # auto = bf16 on CUDA (fp16 if unsupported), fp32 on CPU
    device: str = "auto"  # auto = cuda if available, else cpu
    seed: int = 0
    max_model_len: Optional[int] = None  # None = model's context length (a built-in shape: 4096)
    # KV cache
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: Optional[int] = None  # explicit pool size; default: from free memory on CUDA, 32768 tokens on CPU
    # Reuse the KV of full blocks shared with earlier requests (system prompts, chat history,
    # n > 1): hashed by content (engine/block_manager.py), freed blocks kept until evicted (LRU).
    enable_prefix_caching: bool = True
    # scheduling
    # Most sequences in one batch. None: 512 on a GPU of 70 GiB or more, else 256
    # (``max_num_seqs_for``, resolved once the engine knows its device): fewer, fuller decode
    # steps for a large batch of requests (vLLM's default on such GPUs is 1024).
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: int = 4096
    # Queue step n+1 on the device before reading step n back (it takes step n's sampled
    # tokens on the device; stops apply one step late, the extra token is dropped), so the
    # host's scheduling and detokenizing overlap the GPU's step.
    overlap_scheduling: bool = True
    # While sequences decode, admit waiting prompts only once those that fit the free
    # slots add up to this many tokens (or after one held step per 8 running sequences,
    # at most 32): fewer, larger prefill steps, each stalling the decode batch once.
    # 0 = admit as soon as a slot frees.
    prefill_wave_tokens: int = 2048
    # kernels, decode CUDA graphs and compile
    triton_kernels: bool = True  # Triton kernels for torch.ops.ingot.* on CUDA (False: PyTorch references)
    eager_mode: bool = False
    cudagraph_capture_sizes: Optional[tuple[int, ...]] = None
    decode_compile: Union[bool, str] = False  # False, True or "auto" (per-bucket choice by measurement)
    # Ops that run their PyTorch form under compile, so Inductor fuses them with the glue.
    # Default: every op stays an opaque kernel, which keeps compiled decode bitwise equal to
    # graph-only decode at the same speed (docs/decode-compile.md).
    compile_native_ops: tuple[str, ...] = ()
    # Tensor parallelism: one process per GPU (the engine's own process is rank 0 and spawns
    # the others); heads, MLP and vocabulary split across them (docs/architecture.md).
    # On CPU the ranks talk over gloo (tests); on CUDA over NCCL.
    tensor_parallel_size: int = 1
    # Speculative decoding (n-gram prompt lookup or a draft model; docs/speculative.md): a
    # ``SpeculativeConfig`` or vLLM's dict form, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    # or {"model": "Qwen/Qwen2.5-0.5B-Instruct", "num_speculative_tokens": 4}; None: off.
    speculative_config: Optional[SpeculativeConfig] = None
    # A thinking model's reasoning (vLLM's ``reasoning_parser``): "qwen3" or "deepseek_r1". Structured
    # outputs then constrain the answer after ``</think>``, the reasoning is free (engine/reasoning.py);
    # ``ingot serve`` also returns the reasoning as ``reasoning_content``. None: a constraint applies
    # from a reply's first token.
    reasoning_parser: Optional[str] = None
    # UX
    show_progress: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def create(cls, env: Optional[Mapping[str, str]] = None, **overrides: Any) -> "EngineConfig":
        """Defaults, then INGOT_* variables from ``env`` (os.environ), then ``overrides``."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        env = os.environ if env is None else env
        values = parse_env(env)
        from_env = set(values) - set(overrides)
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as exc:  # a bad value from the environment: name its variable
            if exc.field in from_env:
                var = ENV_PREFIX + exc.field.upper()
                raise ConfigError(f"{var}={env[var]!r}: {exc}", exc.field) from None
            raise

    def validate(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}", "load_format")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS} (or None), got {self.quantization!r}",
                              "quantization")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}", "dtype")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}", "device")
        _positive("block_size", self.block_size)
        if self.max_num_seqs is not None:
            _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.prefill_wave_tokens < 0:
            raise ConfigError(f"prefill_wave_tokens must be >= 0 (0: off), got {self.prefill_wave_tokens}", "prefill_wave_tokens")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("num_kv_blocks must be >= 2 (block 0 is reserved for padding)", "num_kv_blocks")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}", "gpu_memory_utilization"
            )
        if self.cudagraph_capture_sizes is not None:
            self.cudagraph_capture_sizes = tuple(int(s) for s in self.cudagraph_capture_sizes)
            if not self.cudagraph_capture_sizes or min(self.cudagraph_capture_sizes) < 1:
                raise ConfigError("cudagraph_capture_sizes must be positive batch sizes", "cudagraph_capture_sizes")
        if self.decode_compile not in (True, False, "auto"):
            raise ConfigError(f"decode_compile must be True, False or 'auto', got {self.decode_compile!r}", "decode_compile")
        self.compile_native_ops = tuple(self.compile_native_ops)
        bad = [op for op in self.compile_native_ops if op not in FUSIBLE_OPS]
        if bad:
            raise ConfigError(f"compile_native_ops: unknown op(s) {bad}; choose from {FUSIBLE_OPS}", "compile_native_ops")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser must be one of {REASONING_PARSERS} (or None), got "
                              f"{self.reasoning_parser!r}", "reasoning_parser")
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def max_verify_rows(self) -> int:
        """Rows of the largest verify step of speculative decoding (0 without it): at most
        ``min(max_num_seqs, disable_by_batch_size)`` sequences speculate, each a row for its
        last token and one per draft. Needs ``max_num_seqs`` resolved (``for_device``)."""
        spec = self.speculative_config
        if spec is None:
            return 0
        assert self.max_num_seqs is not None, "max_num_seqs is resolved once the device is known"
        return min(self.max_num_seqs, spec.disable_by_batch_size) * (spec.num_speculative_tokens + 1)

    def for_device(self, device_memory: Optional[int]) -> "EngineConfig":
        """This config with the defaults that depend on the device filled in
        (``device_memory``: the GPU's total bytes, None on CPU); itself if none is left open."""
        if self.max_num_seqs is not None:
            return self
        return self.replace(max_num_seqs=max_num_seqs_for(device_memory))


LARGE_GPU_BYTES = 70 * 2**30  # 80 GB-class GPUs and up: a batch of 512 fits their KV cache at common lengths


def max_num_seqs_for(device_memory: Optional[int]) -> int:
    """The default ``max_num_seqs`` of a device with ``device_memory`` bytes (None: CPU)."""
    return 512 if device_memory is not None and device_memory >= LARGE_GPU_BYTES else 256


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", name)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(text: str, name: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={text!r} is not a boolean (use 1/0, true/false, on/off)")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(underlying type, optional?) of a field annotation."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def parse_value(text: str, tp: Any, name: str) -> Any:
    """Parse one environment string into the field type ``tp``."""
    base, optional = _base_type(tp)
    if optional and text.strip().lower() in ("", "none"):
        return None
    if tp == Union[bool, str]:  # a flag with one named extra mode: decode_compile=auto
        if text.strip().lower() == "auto":
            return "auto"
        try:
            return parse_bool(text, name)
        except ConfigError:
            raise ConfigError(f"{name}={text!r}: use 1/0, true/false, on/off or auto") from None
    try:
        if base is SpeculativeConfig:
            return SpeculativeConfig.from_dict(json.loads(text))
        if base is bool:
            return parse_bool(text, name)
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if base is str:
            return text
        if typing.get_origin(base) is tuple:
            (item,) = typing.get_args(base)[:1]
            parts = [p.strip() for p in text.split(",") if p.strip()]
            return tuple(int(p) if item is int else p for p in parts)
    except ConfigError:  # already names the variable
        raise
    except ValueError as exc:
        raise ConfigError(f"{name}={text!r}: {exc}") from None
    raise ConfigError(f"{name}: cannot parse type {tp}")  # pragma: no cover


def parse_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The EngineConfig fields set by INGOT_* variables in ``env``."""
    hints = typing.get_type_hints(EngineConfig)
    out: dict[str, Any] = {}
    for f in fields(EngineConfig):
        var = ENV_PREFIX + f.name.upper()
        if var in env:
            out[f.name] = parse_value(env[var], hints[f.name], var)
    return out
