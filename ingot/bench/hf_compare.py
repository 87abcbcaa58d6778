"""`ingot bench decode --compare-hf`: HF transformers' own decode step, timed on the same shape.

The baseline is what a single-GPU user of transformers gets from its documented
fast path: a ``StaticCache`` and ``torch.compile(model.forward,
mode="reduce-overhead", fullgraph=True)`` (inductor + CUDA graphs). Each batch
size gets its own cache (``context_len`` random tokens prefilled, uncompiled,
in chunks) and its own compile, then single-token decode calls are timed like
ingot's modes: ``time_ms`` (CUDA events on CUDA), median.

transformers is a test dependency of ingot, not a runtime one: it is imported
lazily and a missing install gives a clear error.

Two cache APIs are handled, picked by the signatures of the installed version:

* newer transformers (5.2x): ``StaticCache(config, max_cache_len)`` allocates on
  first use and tracks its own position; ``forward(..., cache=...)`` takes no
  ``cache_position``.
* older (4.4x - early 5.x): ``StaticCache(config, max_batch_size, max_cache_len,
  device, dtype)`` (or ``batch_size``), ``forward(..., past_key_values=...,
  cache_position=...)``; positions are passed explicitly.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ingot.loading.dummy import DEFAULT_SHAPE

HF_MODE = "hf_static_compiled"  # the mode name in the table / JSON
HF_RECIPE = 'transformers StaticCache + torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)'
WARMUP = 5  # decode calls before timing: compile, CUDA-graph recording, then replays
CACHE_MARGIN = 8  # spare cache slots past the last decode position
PREFILL_TOKENS = 8192  # at most batch * chunk tokens per prefill call

# Fallback when transformers' own causal-LM mapping is unavailable.
_MODEL_TYPES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}


class HFCompareError(RuntimeError):
    """transformers is missing, or cannot build / run this model."""


def require_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise HFCompareError(
            f"--compare-hf needs Hugging Face transformers ({exc}); install it with `pip install transformers`"
        ) from exc
    return transformers


# ---------------------------------------------------------------------- building the HF model
def model_type_for(architecture: str) -> str:
    """HF ``model_type`` of a causal-LM class name: Qwen2ForCausalLM -> "qwen2"."""
    if architecture in _MODEL_TYPES:
        return _MODEL_TYPES[architecture]
    require_transformers()
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {}
    # Several model types can share a class (LlamaForCausalLM): prefer the one named like the class.
    types = [t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls == architecture]
    stem = architecture.removesuffix("ForCausalLM").lower()
    for t in types:
        if t.replace("-", "_").replace("_", "") == stem:
            return t
    if len(types) == 1:
        return types[0]
    raise HFCompareError(f"transformers has no single causal LM model type for architecture {architecture!r}"
                         + (f" (candidates: {', '.join(types)})" if types else ""))


def hf_config_for_shape(shape: str):
    """The transformers config of a benchmark shape (``SHAPES[shape]``, its ``architectures`` giving the model type)."""
    from ingot.loading.dummy import SHAPES

    transformers = require_transformers()
    fields = dict(SHAPES[shape])
    archs = fields.pop("architectures", None) or []
    if not archs:
        raise HFCompareError(f"shape {shape!r} names no architecture")
    return transformers.AutoConfig.for_model(model_type_for(archs[0]), **fields)


def _dtype_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    """``dtype=`` on transformers >= 4.56, ``torch_dtype=`` before."""
    transformers = require_transformers()
    try:
        major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    except ValueError:
        return {"dtype": dtype}
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def build_hf_model(source: Optional[str], shape: Optional[str], dtype: torch.dtype, device: torch.device):
    """The transformers model for ``--model`` (its weights; a .gguf file through ``gguf_file=``) or
    ``--shape`` (random weights, built directly on ``device``), in eval mode."""
    transformers = require_transformers()
    device = torch.device(device)
    if source is None:
        if shape is None:
            raise HFCompareError("build_hf_model needs a source or a shape")
        config = hf_config_for_shape(shape)
        with torch.device(device):  # initialise on the device: a 7B init on the host takes minutes
            model = transformers.AutoModelForCausalLM.from_config(config, **_dtype_kwargs(dtype))
    else:
        path = Path(source)
        if path.suffix == ".gguf" and path.is_file():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, **_dtype_kwargs(dtype))
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(source, **_dtype_kwargs(dtype))
    model = model.to(device=device, dtype=dtype)
    model.eval()
    return model


# ---------------------------------------------------------------------- the decode loop
def make_static_cache(model, batch: int, max_cache_len: int, device: torch.device, dtype: torch.dtype):
    """A ``transformers.StaticCache`` for ``batch`` rows of ``max_cache_len`` tokens, whatever the signature."""
    transformers = require_transformers()
    cls = transformers.StaticCache
    params = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": max_cache_len}
    if "max_batch_size" in params:
        kwargs["max_batch_size"] = batch
    elif "batch_size" in params:
        kwargs["batch_size"] = batch
    if "device" in params:
        kwargs["device"] = device
    if "dtype" in params:
        kwargs["dtype"] = dtype
    return cls(**kwargs)


def _forward_params(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


class HFDecoder:
    """Prefill, then single-token decode steps of a transformers model into one static cache.

    ``step(tokens)`` runs ``model(input_ids=tokens[:, None], <cache>=cache, [cache_position=...], use_cache=True)``,
    compiled when ``compile`` is set (reduce-overhead + fullgraph on CUDA; the eager backend elsewhere,
    which still checks the forward traces as one graph). Positions advance by one per step and never
    pass ``max_cache_len``.
    """

    def __init__(self, model, batch: int, max_cache_len: int, compile: bool = False, prefill_tokens: int = PREFILL_TOKENS):
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.batch, self.max_cache_len = batch, max_cache_len
        self.prefill_tokens = prefill_tokens
        self.cache = make_static_cache(model, batch, max_cache_len, self.device, self.dtype)
        params = _forward_params(model)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.explicit_positions = "cache_position" in params  # older API; newer caches track their position
        self.keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.positions = torch.arange(max_cache_len, device=self.device)
        self.pos = 0
        self.forward: Callable[..., Any] = model.forward
        if compile:
            if self.device.type == "cuda":
                self.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            else:
                self.forward = torch.compile(model.forward, backend="eager", fullgraph=True)

    def _kwargs(self, start: int, n: int) -> dict[str, Any]:
        if start + n > self.max_cache_len:
            raise HFCompareError(f"decode position {start + n} is past the static cache's {self.max_cache_len} slots")
        kw: dict[str, Any] = {self.cache_kw: self.cache, "use_cache": True}
        if self.explicit_positions:
            kw["cache_position"] = self.positions[start:start + n]
        return kw

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids`` [batch, n] uncompiled, in chunks of at most ``prefill_tokens`` tokens; last-position logits."""
        assert ids.shape[0] == self.batch, (ids.shape, self.batch)
        chunk = max(1, self.prefill_tokens // self.batch)
        logits = None
        for s in range(0, ids.shape[1], chunk):
            part = ids[:, s:s + chunk]
            kw = self._kwargs(self.pos, part.shape[1])
            if self.keep_kw is not None:
                kw[self.keep_kw] = 1  # not a [batch, n, vocab] logits tensor
            logits = self.model(input_ids=part, **kw).logits[:, -1]
            self.pos += part.shape[1]
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step: ``tokens`` [batch] at the next position; logits [batch, vocab] (only valid until the next step)."""
        out = self.forward(input_ids=tokens[:, None], **self._kwargs(self.pos, 1))
        self.pos += 1
        return out.logits[:, -1]


def hf_decode_logits(model, prompt: torch.Tensor, tokens: torch.Tensor, compile: bool = False,
                     prefill_tokens: int = PREFILL_TOKENS) -> torch.Tensor:
    """Prefill ``prompt`` [batch, P], then decode ``tokens`` [batch, N] one per step: logits [N, batch, vocab]
    (step i's logits predict the token after ``tokens[:, i]``)."""
    n = tokens.shape[1]
    dec = HFDecoder(model, prompt.shape[0], prompt.shape[1] + n + CACHE_MARGIN, compile, prefill_tokens)
    dec.prefill(prompt)
    return torch.stack([dec.step(tokens[:, i]).float().clone() for i in range(n)])


@dataclass
class HFTiming:
    ms: float  # median ms per decode step
    warmup_s: float  # seconds of the warm-up calls (the compile and CUDA-graph recording with compile)
    cudagraph_skips: int = 0  # inductor's count of graphs it ran without CUDA graphs (0 = reduce-overhead took)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cudagraph_skips() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001 - a private counter; missing means unknown
        return 0


def time_hf_decode(model, batch: int, context_len: int, iters: int, compile: bool, warmup: int = WARMUP) -> HFTiming:
    """Median ms of a decode step of ``batch`` rows at ``context_len`` cached tokens, and the warm-up seconds."""
    from ingot.runner.auto_compile import time_ms

    if compile:
        torch._dynamo.reset()  # a compile of its own per batch size, as a user timing one batch size gets
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size
    dec = HFDecoder(model, batch, context_len + warmup + iters + CACHE_MARGIN, compile)
    gen = torch.Generator(device="cpu").manual_seed(0)
    hi = min(1000, vocab)
    dec.prefill(torch.randint(0, hi, (batch, context_len), generator=gen).to(dec.device))
    tok = torch.randint(0, hi, (batch,), generator=gen).to(dec.device)
    fn = lambda: dec.step(tok)  # noqa: E731
    _sync(dec.device)
    skips = _cudagraph_skips()
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    _sync(dec.device)
    warmup_s = time.perf_counter() - t0
    ms = statistics.median(time_ms(fn, iters, dec.device, warmup=0))
    return HFTiming(ms, warmup_s, _cudagraph_skips() - skips)


def hf_decode_ms(model, batch: int, context_len: int, iters: int, compile: bool) -> float:
    """Median ms per decode step of a transformers model with a static cache (see ``time_hf_decode``)."""
    return time_hf_decode(model, batch, context_len, iters, compile).ms


# ---------------------------------------------------------------------- the CLI's hook
def _warn(msg: str) -> None:
    print(f"ingot bench decode: warning: --compare-hf: {msg}", file=sys.stderr)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def add_hf_mode(bench, args, device: torch.device, dtype: torch.dtype) -> bool:
    """Time transformers' static-cache compiled decode for every batch size of ``bench`` and add it as mode
    ``HF_MODE`` to its rows (ms and warm-up seconds). Any failure is a warning: the bench goes on without
    it (a batch size that fails, e.g. out of memory, is left out alone). True if any batch size was timed."""
    try:
        transformers = require_transformers()
        model = build_hf_model(args.model, None if args.model else (args.shape or DEFAULT_SHAPE), dtype, device)
    except Exception as exc:  # noqa: BLE001 - the comparison is optional
        _warn(f"skipped, transformers cannot build the model: {type(exc).__name__}: {exc}")
        _free(device)
        return False
    timed = False
    skipped: list[int] = []
    try:
        for row in bench.rows:
            try:
                t = time_hf_decode(model, row.batch, args.context_len, args.iters, compile=True)
            except Exception as exc:  # noqa: BLE001
                _warn(f"batch {row.batch} skipped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                _free(device)
                continue
            row.ms[HF_MODE] = t.ms
            row.warmup_s[HF_MODE] = t.warmup_s
            if t.cudagraph_skips and device.type == "cuda":
                _warn(f"batch {row.batch}: inductor skipped CUDA graphs {t.cudagraph_skips}x (see TORCH_LOGS=perf_hints); "
                      "its time is compiled without CUDA graphs")
                skipped.append(row.batch)
            timed = True
    finally:
        del model
        torch._dynamo.reset()
        _free(device)
    if timed:
        if HF_MODE not in bench.modes:
            bench.modes.append(HF_MODE)
        bench.env["transformers"] = transformers.__version__
        bench.env["hf_compare"] = HF_RECIPE
        if skipped:
            bench.env["hf_compare_no_cudagraphs_batches"] = skipped
    return timed

