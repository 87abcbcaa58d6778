"""Executor: the one interface between the engine and the device(s).

The engine decides what runs (which requests, which KV block ids); an executor
runs it: a ``ModelRunner`` on one device, or a ``TensorParallelRunner`` over a
group of processes, one per GPU. The engine sizes and allocates the KV pool,
captures the decode graphs and launches steps through this interface alone, so
it never touches a device, a model or a process group.

``run_on_ranks`` is the extension point for tools on top (``ingot check
drift``, ``ingot bench decode``): it runs a picklable function on every rank's
``ModelRunner`` in lockstep, so what only a benchmark needs lives in the
benchmark and still works over N ranks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, TypeVar

import torch

from ingot.config import EngineConfig
from ingot.loading.checkpoint import Checkpoint
from ingot.models.loader import device_memory, load_checkpoint, resolve_device, resolve_dtype
from ingot.models.registry import check_tensor_parallel
from ingot.runner.batch import ScheduledBatch
from ingot.runner.draft_runner import DraftedModelRunner, load_draft
from ingot.runner.eagle_runner import EagleRunner, load_eagle, open_eagle, vocab_tables
from ingot.runner.model_runner import LaunchedStep, ModelRunner, TokenFeed
from ingot.runner.tp_runner import TensorParallelRunner

T = TypeVar("T")


class Executor(Protocol):
    config: EngineConfig  # the engine's configuration, its device-dependent defaults resolved
    device: torch.device  # the device the driver samples on

    def num_kv_blocks(self) -> int:
        """KV blocks the pool can hold (every rank's minimum)."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def setup_decode_graphs(self, max_blocks_per_seq: int) -> None:
        """Capture the decode graphs (CUDA), after the pool is allocated."""
        ...

    def launch(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...], feed: Optional[TokenFeed] = None) -> LaunchedStep:
        """Queue one step; its samples come back through ``LaunchedStep.collect``."""
        ...

    def generator(self, seed: int) -> torch.Generator:
        """A seeded random generator where sampling runs (a request's own seed)."""
        ...

    def make_current(self) -> None:
        """Make the executor's device current in the calling thread (a new thread starts on GPU 0)."""
        ...

    def run_on_ranks(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(runner, *args)`` on every rank's ModelRunner in lockstep; rank 0's result.
        ``fn`` and ``args`` must pickle (module-level functions) under tensor parallelism."""
        ...

    def close(self) -> None:
        """Release the executor's processes; it is unusable after."""
        ...


def create_executor(config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> Executor:
    """The model of ``checkpoint`` loaded on ``config``'s device (split over
    ``tensor_parallel_size`` GPUs, one process each), with its draft model beside it when
    ``speculative_config`` names one, ready to size its KV pool."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, checkpoint.config.torch_dtype)
    config = config.for_device(device_memory(device))
    if config.tensor_parallel_size > 1:
        check_tensor_parallel(checkpoint.config, config.tensor_parallel_size)  # before anything is spawned
    drafting = _drafting(config, checkpoint, device, dtype, max_model_len)  # before the target loads
    if config.tensor_parallel_size > 1:
        with_draft = None if drafting is None else (lambda group: drafting(group.local, group.run_on_ranks))
        return TensorParallelRunner.start(config, checkpoint, device, dtype, max_model_len, with_draft)
    model = load_checkpoint(checkpoint, dtype, device, max_model_len, progress=config.show_progress)
    runner = ModelRunner(model, checkpoint.config, config, device, dtype)
    return runner if drafting is None else drafting(runner, runner.run_on_ranks)


# ``drafting(target, on_ranks)``: the target's runner with a draft beside it (on the driver under
# tensor parallelism; ``on_ranks(fn)`` runs ``fn`` on every rank's runner, the driver's result)
Drafting = Callable[[ModelRunner, Callable[..., Any]], ModelRunner]


def _drafting(config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
              max_model_len: int) -> Optional[Drafting]:
    """How the target's runner gets the draft model or EAGLE head ``speculative_config`` names
    (None without one), opened (a draft model: loaded) first, so a bad one fails before the
    target loads."""
    spec = config.speculative_config
    if spec is None or not spec.uses_draft_model:
        return None
    if spec.uses_eagle:
        head = open_eagle(config, checkpoint)
        return lambda target, on_ranks: EagleRunner(
            target.model, target.model_config, config, device, dtype,
            load_eagle(config, head, on_ranks(vocab_tables), device, dtype, max_model_len), checkpoint.config.vocab_size)
    draft, propose_vocab = load_draft(config, checkpoint, device, dtype, max_model_len)
    return lambda target, on_ranks: DraftedModelRunner(target.model, target.model_config, config, device, dtype, draft,
                                                       propose_vocab)
