"""A tensor-parallel worker process: one rank (1 .. size - 1) on its own device.

Spawned by the driver (``tp_workers.py``). It joins the group, loads its shard,
reports ``ready`` on its status pipe and mirrors the driver (``RankState.serve``)
until told to stop. It never outlives the driver: Ctrl-C is the driver's to
handle (ignored here), and a thread waits on the lifeline pipe, whose far end
only the driver holds, and ends the process when it closes (the driver exited,
was killed, or gave up on the group). A failure anywhere is sent as its
traceback text to the driver, then the process exits, which also breaks any
collective the driver is waiting in.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ingot.config import EngineConfig
from ingot.distributed import process_group
from ingot.loading.model_config import ModelConfig
from ingot.models.loader import load_checkpoint, open_model
from ingot.runner.kv_pool import blocks_for
from ingot.runner.model_runner import ModelRunner
from ingot.runner.step_channel import StepChannel, capacity_for
from ingot.runner.tp_rank import RankState


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its rank (picklable)."""

    size: int
    port: int  # of the rendezvous store
    config: EngineConfig  # every rank opens the checkpoint it names and loads its own shard
    devices: tuple[str, ...]  # one per rank
    dtype: torch.dtype
    max_model_len: int


def rank_config(model: torch.nn.Module) -> ModelConfig:
    """The ModelConfig of one rank's shard: its own query and KV heads (what its KV pool holds)."""
    attn = model.attention_layers()[0]
    return dataclasses.replace(model.config, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads)


def build_rank(model: torch.nn.Module, spec: WorkerSpec, device: torch.device) -> RankState:
    """The rank's runner and step channel (the driver builds its own the same way)."""
    runner = ModelRunner(model, rank_config(model), spec.config, device, spec.dtype)
    capacity = capacity_for(spec.config, blocks_for(spec.max_model_len, spec.config.block_size))
    return RankState(runner, StepChannel(capacity, runner.tp, device))


def _watch_lifeline(lifeline: Any) -> None:
    def wait() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        os._exit(0)  # the driver is gone: nothing here is worth waiting for

    threading.Thread(target=wait, name="ingot-tp-lifeline", daemon=True).start()


def worker_main(rank: int, spec: WorkerSpec, status: Any, lifeline: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_lifeline(lifeline)
    # loading shows no bar here; a thread lock keeps tqdm from making a multiprocessing
    # semaphore, which the quick exit below would leave to the resource tracker
    tqdm.set_lock(threading.RLock())
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp{rank} %(name)s: %(message)s")
    try:
        device = torch.device(spec.devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
        status.send(("hello", rank))
        tp = process_group.join(rank, spec.size, device, port=spec.port)
        model = load_checkpoint(open_model(spec.config), spec.dtype, device, spec.max_model_len, progress=False, tp=tp)
        state = build_rank(model, spec, device)
        status.send(("ready", rank))
        state.serve()
        process_group.leave()
        status.send(("stopped", rank))
    except BaseException:
        try:
            status.send(("error", rank, traceback.format_exc()))
        finally:
            _exit(1)  # no clean-up that could wait on the group
    _exit(0)


def _exit(code: int) -> None:
    """End now: the interpreter's own teardown (a second with torch loaded) has nothing to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
