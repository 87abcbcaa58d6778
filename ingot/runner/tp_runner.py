"""TensorParallelRunner: the engine's runner when the model is split over several processes.

The engine's process is rank 0, the driver: it holds the scheduler (in the
engine), a shard of the model like every rank, and the only sampler. Each
step it packs the step's inputs into its step buffer and broadcasts it (one
broadcast per step, ``step_channel.py``); every rank then runs the same device
part of the step (``ModelRunner.run_model``) on the same inputs, and the
collectives inside the forward (all-reduces after the row-parallel
projections and the embedding, the all-gather of the lm_head's vocabulary
slices) pair up across ranks. The driver samples from the full logits; the
workers drop theirs.

Start-up (KV pool size, pool allocation, graph capture) and whatever a tool on
top runs through ``run_on_ranks`` are functions the driver sends in a call
message and every rank applies to its own ``ModelRunner``. A step that fails on the driver or any worker leaves the ranks
out of step, so the group is shut down and every later call raises
``TensorParallelError`` carrying the first failure (a worker's traceback).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Optional, TypeVar

import torch

from ingot.config import ConfigError, EngineConfig
from ingot.distributed import process_group
from ingot.distributed.collectives import broadcast_object
from ingot.loading.checkpoint import Checkpoint
from ingot.models.loader import load_checkpoint
from ingot.runner.batch import ScheduledBatch
from ingot.runner.draft_runner import DraftedModelRunner
from ingot.runner.model_runner import LaunchedStep, ModelRunner, TokenFeed
from ingot.runner.prompt_logprobs import prompt_spans
from ingot.runner.sampler import SamplerOutput
from ingot.runner.step_channel import Kind
from ingot.runner.step_inputs import StepInputs, host_step
from ingot.runner.tp_rank import RankState, min_kv_blocks
from ingot.runner.tp_worker import WorkerSpec, build_rank
from ingot.runner.tp_workers import TensorParallelError, WorkerGroup

log = logging.getLogger(__name__)

__all__ = ["TensorParallelRunner", "TensorParallelError", "rank_devices"]
T = TypeVar("T")

# how long the driver waits for a worker to report why a collective broke
_FAILURE_WAIT_S = 10.0
# how long a graceful shutdown waits for the workers to leave
_STOP_WAIT_S = 30.0


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """One device per rank: cuda:N .. cuda:N + size - 1 from the driver's cuda:N; all CPU on CPU."""
    if device.type != "cuda":
        return [device] * size
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + size > count:
        raise ConfigError(f"tensor_parallel_size={size} from {device} needs GPUs {first}..{first + size - 1}, "
                          f"but PyTorch sees {count}", "tensor_parallel_size")
    return [torch.device("cuda", first + r) for r in range(size)]


class TensorParallelRunner:
    """Rank 0 of the group: the engine's ``Executor`` over several processes."""

    def __init__(self, state: RankState, workers: WorkerGroup) -> None:
        self.state = state
        self.local = state.runner
        self.config = self.local.config
        self.device = self.local.device
        self.workers = workers
        self._lock = threading.RLock()  # one step or call at a time; close() waits for it
        self._down: Optional[str] = None
        self._closed = False
        workers.on_failure = self._on_worker_failure
        self._finalizer = weakref.finalize(self, _stop_at_exit, workers)

    @classmethod
    def start(
        cls, config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype, max_model_len: int,
        drafting: Optional[Callable[["TensorParallelRunner"], ModelRunner]] = None,
    ) -> "TensorParallelRunner":
        """Spawn the workers, join the group with them and load rank 0's shard of ``checkpoint``
        (every worker opens the checkpoint ``config`` names and loads its own). The model's
        shape must already have passed ``registry.check_tensor_parallel``. ``drafting``: the
        driver's runner with a draft beside its shard (``DraftedModelRunner``), built from the
        group's runner (it may call ``run_on_ranks``); the draft runs on the driver alone."""
        size = config.tensor_parallel_size
        devices = rank_devices(device, size)
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])  # c10d's object broadcasts use the current device
        process_group.set_collective_env()  # before the workers are spawned: they inherit it
        store = process_group.create_store(size)
        spec = WorkerSpec(size, store.port, config, tuple(str(d) for d in devices), dtype, max_model_len)
        workers = WorkerGroup(spec)
        joined = False
        try:
            workers.wait_for("hello")
            tp = process_group.join(0, size, devices[0], store=store)
            joined = True
            model = load_checkpoint(checkpoint, dtype, devices[0], max_model_len, progress=config.show_progress, tp=tp)
            workers.wait_for("ready")
            runner = cls(build_rank(model, spec, devices[0]), workers)
        except BaseException as exc:
            # the driver's own bad model or setting (ValueError: ConfigError, CheckpointError) is
            # every rank's; a broken collective is the consequence of a worker's failure
            failure = workers.wait_failure(1.0) if isinstance(exc, RuntimeError) else None
            workers.stop(0.0)
            if joined:
                process_group.leave(abort=True)
            if failure is not None and not isinstance(exc, TensorParallelError):
                raise TensorParallelError(failure) from exc
            raise
        if drafting is not None:
            try:
                runner.local = runner.state.runner = drafting(runner)
            except BaseException:
                runner.close()
                raise
        return runner

    # ------------------------------------------------------------------ start-up and calls
    def num_kv_blocks(self) -> int:
        return self.run_on_ranks(min_kv_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.run_on_ranks(_allocate_kv_cache, num_blocks)

    def setup_decode_graphs(self, max_blocks_per_seq: int) -> None:
        self.run_on_ranks(_setup_decode_graphs, max_blocks_per_seq)

    def generator(self, seed: int) -> torch.Generator:
        return self.local.generator(seed)

    def make_current(self) -> None:
        self.local.make_current()

    def run_on_ranks(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(runner, *args)`` on every rank in lockstep (``fn`` and ``args`` pickled to the
        workers); the driver's result."""
        with self._lock:
            self._check()
            try:
                self.state.channel.send(Kind.CALL)
                broadcast_object((fn, args), self.state.tp)
                return self._checked(fn(self.local, *args))
            except BaseException as exc:
                self._break(exc)

    # ------------------------------------------------------------------ steps
    def stage(self, batch: ScheduledBatch) -> StepInputs:
        """Pack a step into the step buffer (sent by the next ``launch``)."""
        spans = [(s.start, s.stop) for s in prompt_spans(batch)]
        with self._lock:
            self._check()
            return self.state.channel.stage(host_step(batch, self.local.block_size), spans)

    def launch(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...], feed: Optional[TokenFeed] = None) -> LaunchedStep:
        """``ModelRunner.launch`` over the group: the step (with ``feed``'s tokens written into
        the driver's step buffer on the device first) is broadcast, every rank runs it, and
        the driver queues the sampling. With a draft beside the driver's shard, the driver
        runs it as ``DraftedModelRunner.launch`` does: its round before a verify step is
        staged, its K/V of a plain step after the step is queued."""
        drafted = self.local if isinstance(self.local, DraftedModelRunner) else None
        with self._lock:
            if drafted is not None and batch.draft_tokens is not None:
                self._check()
                try:
                    drafted.propose(batch, eos_token_ids)
                except BaseException as exc:
                    self._break(exc)
            inputs = self.stage(batch)
            if feed is not None:
                feed.apply(inputs, batch)  # into the buffer, before it is sent
            try:
                self.state.channel.send(Kind.STEP)
                step = self.local.launch_staged(batch, inputs, eos_token_ids)
                if drafted is not None and batch.draft_tokens is None and batch.draft_follows:
                    drafted.follow(batch, inputs, feed)
            except BaseException as exc:
                self._break(exc)
            return _Checked(step, self)

    # ------------------------------------------------------------------ failure and shutdown
    def _check(self) -> None:
        if self._down is None and self.workers.failure is not None:
            self._down = self.workers.failure
            self._shutdown(graceful=False)
        if self._down is not None:
            raise TensorParallelError(f"the tensor-parallel group is down: {self._down}")

    def _checked(self, result: Any) -> Any:
        """``result`` unless a worker failed meanwhile: an aborted NCCL collective returns
        without error, and what it computed is garbage."""
        if self.workers.failure is not None:
            raise TensorParallelError(self.workers.failure)
        return result

    def _on_worker_failure(self, message: str) -> None:
        """Monitor thread: a worker died. NCCL collectives waiting on it never end by themselves."""
        if self.local.device.type == "cuda":
            process_group.leave(abort=True)

    def _break(self, exc: BaseException) -> None:
        """A step or call failed part-way: the ranks are out of step, so the group goes down."""
        if isinstance(exc, KeyboardInterrupt):
            reason = "interrupted during a step"
        else:
            failure = self.workers.wait_failure(_FAILURE_WAIT_S if isinstance(exc, RuntimeError) else 0.0)
            reason = failure or f"the driver failed during a step: {type(exc).__name__}: {exc}"
        self._down = reason
        self._shutdown(graceful=False)
        if isinstance(exc, KeyboardInterrupt):
            raise exc
        raise TensorParallelError(reason) from exc

    def close(self) -> None:
        """Stop the workers (gracefully when the group is healthy and idle) and leave the group."""
        idle = self._lock.acquire(timeout=_STOP_WAIT_S)
        try:
            if not self._closed:
                self._shutdown(graceful=idle and self._down is None and self.workers.alive())
                self._down = self._down or "closed"
        finally:
            if idle:
                self._lock.release()

    def _shutdown(self, graceful: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self.workers.expect_exit()
        if graceful:
            try:
                self.state.channel.send(Kind.STOP)
            except Exception:
                graceful = False
        self.workers.stop(_STOP_WAIT_S if graceful else 0.0)
        process_group.leave(abort=not graceful)
        self._finalizer.detach()


class _Checked(LaunchedStep):
    """A launched step whose samples are only handed out if no worker failed meanwhile."""

    def __init__(self, step: LaunchedStep, runner: TensorParallelRunner) -> None:
        self.step = step
        self.runner = runner
        self.rows = step.rows
        self.sample = step.sample

    def collect(self) -> SamplerOutput:
        return self.runner._checked(self.step.collect())


def _allocate_kv_cache(runner: ModelRunner, num_blocks: int) -> None:
    runner.allocate_kv_cache(num_blocks)  # (the driver's may be a DraftedModelRunner's)


def _setup_decode_graphs(runner: ModelRunner, max_blocks_per_seq: int) -> None:
    runner.setup_decode_graphs(max_blocks_per_seq)


def _stop_at_exit(workers: WorkerGroup) -> None:
    """Safety net when a runner is collected or the interpreter exits without ``close``."""
    workers.stop(0.0)
    process_group.leave(abort=True)
