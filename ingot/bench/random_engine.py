"""An engine over a random-weight model of a benchmark shape (``--shape`` of the bench commands).

Serving throughput depends on the model's shapes, not its weights, so a user
without the checkpoint (or a machine without network) can still measure a
Qwen2.5-7B-sized deployment. Without ``config.tokenizer`` the tokenizer is a
word-level one that spells token ``i`` as ``<i>`` (bench workloads send token
ids, and detokenizing their output still has to work); with it (a model path,
or ``default`` for the default model), that model's tokenizer and vocabulary
size, so detokenizing costs what it costs with real weights.
"""

from __future__ import annotations

from typing import Optional

import tokenizers

from ingot.bench.decode import SHAPES, build_shape, shape_config
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.model_config import ModelConfig
from ingot.loading.tokenizer import Tokenizer
from ingot.models.loader import resolve_device, resolve_dtype
from ingot.runner.model_source import RandomSource
from ingot.runner.tp_runner import start_tensor_parallel

# enough for the bench workloads (prompts up to 1024, outputs up to 512) with room to spare
DEFAULT_MAX_MODEL_LEN = 4096


def id_tokenizer(vocab_size: int) -> Tokenizer:
    """Token ``i`` <-> the word ``<i>``; no special tokens, no EOS."""
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="\x00", cleanup=False)  # joins words with spaces
    return Tokenizer(tok)


def random_engine(shape: str, config: EngineConfig, num_layers: Optional[int] = None) -> Engine:
    """An Engine whose model has ``shape`` (a key of SHAPES, ``num_layers`` decoder layers if
    given) and seeded random weights (split over ``config.tensor_parallel_size`` ranks, each
    initialising its own shard)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(sorted(SHAPES))}")
    config.validate()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    max_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN
    tokenizer = shape_tokenizer(shape, config)
    if config.tensor_parallel_size > 1:
        hf = shape_config(shape, tokenizer.vocab_size, num_layers)
        cfg = ModelConfig.from_hf(hf)
        runner = start_tensor_parallel(config, RandomSource(hf), cfg, device, dtype, max_len)
        return Engine(config, runner.model, cfg, tokenizer, runner.device, dtype, max_len, runner=runner)
    model, cfg = build_shape(shape, dtype, device, max_len, vocab_size=tokenizer.vocab_size, num_layers=num_layers)
    return Engine(config, model, cfg, tokenizer, device, dtype, max_len)


def shape_tokenizer(shape: str, config: EngineConfig) -> Tokenizer:
    """The tokenizer of a random engine: ``config.tokenizer``'s (``default``: the default
    model's), else token-id words over the shape's vocabulary."""
    if config.tokenizer:
        return open_checkpoint(None if config.tokenizer == "default" else config.tokenizer).tokenizer
    return id_tokenizer(SHAPES[shape]["vocab_size"])
