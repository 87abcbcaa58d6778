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

Start-up and control (KV pool size, pool allocation, graph capture, decode
variants) are ``RankState`` methods the driver names in a control message and
every rank runs. A step that fails on the driver or any worker leaves the ranks
out of step, so the group is shut down and every later call raises
``TensorParallelError`` carrying the first failure (a worker's traceback).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Optional

import torch

from ingot.config import ConfigError, EngineConfig
from ingot.distributed import process_group
from ingot.distributed.collectives import broadcast_object
from ingot.loading.model_config import ModelConfig
from ingot.models.loader import device_memory
from ingot.models.registry import check_tensor_parallel
from ingot.runner.batch import ScheduledBatch
from ingot.runner.graph_runner import DecodeGraphRunner
from ingot.runner.model_runner import LaunchedStep, TokenFeed
from ingot.runner.model_source import ModelSource
from ingot.runner.prompt_logprobs import prompt_spans
from ingot.runner.sampler import SamplerOutput
from ingot.runner.step_channel import Kind
from ingot.runner.step_inputs import StepInputs, host_step
from ingot.runner.tp_rank import RankState
from ingot.runner.tp_worker import WorkerSpec, build_rank
from ingot.runner.tp_workers import TensorParallelError, WorkerGroup

log = logging.getLogger(__name__)

__all__ = ["TensorParallelRunner", "TensorParallelError", "rank_devices", "start_tensor_parallel"]

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
    """Rank 0 of the group; the engine, drift checks and benchmarks use it like a ModelRunner."""

    def __init__(self, state: RankState, workers: WorkerGroup) -> None:
        self.state = state
        self.local = state.runner
        self.workers = workers
        self._lock = threading.RLock()  # one step or control call at a time; close() waits for it
        self._down: Optional[str] = None
        self._closed = False
        workers.on_failure = self._on_worker_failure
        self._finalizer = weakref.finalize(self, _stop_at_exit, workers)

    @classmethod
    def start(
        cls, config: EngineConfig, source: ModelSource, device: torch.device, dtype: torch.dtype, max_model_len: int
    ) -> "TensorParallelRunner":
        """Spawn the workers, join the group with them and load rank 0's shard. The model's shape
        must already have passed ``registry.check_tensor_parallel``."""
        size = config.tensor_parallel_size
        devices = rank_devices(device, size)
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])  # c10d's object broadcasts use the current device
        process_group.set_collective_env()  # before the workers are spawned: they inherit it
        store = process_group.create_store(size)
        spec = WorkerSpec(size, store.port, config, source, tuple(str(d) for d in devices), dtype, max_model_len)
        workers = WorkerGroup(spec)
        joined = False
        try:
            workers.wait_for("hello")
            tp = process_group.join(0, size, devices[0], store=store)
            joined = True
            model = source.load(tp, devices[0], dtype, max_model_len, progress=config.show_progress)
            workers.wait_for("ready")
            return cls(build_rank(model, spec, devices[0]), workers)
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

    # ------------------------------------------------------------------ what the engine reads
    @property
    def model(self) -> torch.nn.Module:
        return self.local.model

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def model_config(self) -> ModelConfig:
        """This rank's shard: its query and KV heads."""
        return self.local.model_config

    @property
    def config(self) -> EngineConfig:
        return self.local.config

    @property
    def policy(self):
        return self.local.policy

    @property
    def kv(self):
        return self.local.kv

    @property
    def tp(self):
        return self.local.tp

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids

    @property
    def graphs(self) -> Optional[DecodeGraphRunner]:
        return self.local.graphs

    @graphs.setter
    def graphs(self, graphs: Optional[DecodeGraphRunner]) -> None:
        """Which graphs engine steps replay, on every rank (drift checks swap variants in)."""
        self._call("use_graphs", self.state.variant_id(graphs))

    # ------------------------------------------------------------------ control
    def num_kv_blocks(self) -> int:
        return self._call("num_kv_blocks")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def setup_decode_graphs(self, max_blocks_per_seq: int) -> None:
        self._call("setup_decode_graphs", max_blocks_per_seq)

    def decode_variant(self, config: EngineConfig, max_blocks_per_seq: int) -> DecodeGraphRunner:
        return self.state.variants[self._call("decode_variant", config, max_blocks_per_seq)]

    def drop_variant(self, graphs: DecodeGraphRunner) -> None:
        self._call("drop_variant", self.state.variant_id(graphs))

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            self._check()
            try:
                self.state.channel.send(Kind.CALL)
                broadcast_object((method, args), self.tp)
                return self._checked(self.state.call(method, args))
            except BaseException as exc:
                self._break(exc)

    # ------------------------------------------------------------------ steps
    def stage(self, batch: ScheduledBatch) -> StepInputs:
        """Pack a step into the step buffer (sent by the next ``execute`` or ``logits_of``)."""
        spans = [(s.start, s.stop) for s in prompt_spans(batch)]
        with self._lock:
            self._check()
            return self.state.channel.stage(host_step(batch, self.local.block_size), spans)

    def execute(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...]) -> tuple[list[int], SamplerOutput]:
        step = self.launch(batch, eos_token_ids)
        return step.rows, step.collect()

    def launch(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...], feed: Optional[TokenFeed] = None) -> LaunchedStep:
        """``ModelRunner.launch`` over the group: the step (with ``feed``'s tokens written into
        the driver's step buffer on the device first) is broadcast, every rank runs it, and
        the driver queues the sampling."""
        with self._lock:
            inputs = self.stage(batch)
            if feed is not None:
                feed.apply(inputs, batch)  # into the buffer, before it is sent
            try:
                self.state.channel.send(Kind.STEP)
                step = self.local.launch_staged(batch, inputs, eos_token_ids)
            except BaseException as exc:
                self._break(exc)
            return _Checked(step, self)

    def logits_of(self, graphs: Optional[DecodeGraphRunner], inputs: StepInputs) -> torch.Tensor:
        """Logits of the staged decode step (``stage``), replayed by ``graphs`` (None: raw) on every rank."""
        with self._lock:
            self._check()
            try:
                self.state.channel.send(Kind.LOGITS, self.state.variant_id(graphs))
                return self._checked(self.local.logits_of(graphs, inputs))
            except BaseException as exc:
                self._break(exc)

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


def _stop_at_exit(workers: WorkerGroup) -> None:
    """Safety net when a runner is collected or the interpreter exits without ``close``."""
    workers.stop(0.0)
    process_group.leave(abort=True)


def start_tensor_parallel(
    config: EngineConfig, source: ModelSource, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
    max_model_len: int,
) -> TensorParallelRunner:
    """ConfigError if ``model_config`` cannot be split over ``config.tensor_parallel_size`` ranks
    (nothing is spawned then); else the started runner."""
    check_tensor_parallel(model_config, config.tensor_parallel_size)
    config = config.for_device(device_memory(device))  # every rank gets the resolved copy
    return TensorParallelRunner.start(config, source, device, dtype, max_model_len)
