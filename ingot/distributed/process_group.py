"""The tensor-parallel process group: NCCL between GPUs, gloo on CPU; rendezvous on a free port.

Rank 0 (the engine's process) creates the rendezvous store on a port the
kernel picks (port 0), then every rank joins the default group through it; the
group is the whole world, so one process takes part in one tensor-parallel
group at a time. NVLink multicast (NVLS) and symmetric-memory multicast stay
off: the shared machines do not allow it, and the workers inherit the setting
from the environment set here before they are spawned.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from ingot.distributed.parallel import TensorParallel

HOST = "127.0.0.1"
# settings every rank needs before NCCL starts (setdefault: a user's explicit value wins)
COLLECTIVE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# how long a rank waits for the others to join or answer; steps that compile take minutes
TIMEOUT = datetime.timedelta(minutes=30)


class ProcessGroupError(RuntimeError):
    """The tensor-parallel group cannot be created (another one is active in this process)."""


def set_collective_env() -> None:
    for name, value in COLLECTIVE_ENV.items():
        os.environ.setdefault(name, value)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def create_store(world_size: int) -> dist.TCPStore:
    """The rendezvous store, listening on a free port (``store.port``) of the loopback address."""
    return dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def join(rank: int, size: int, device: torch.device, store: Optional[dist.Store] = None, port: Optional[int] = None) -> TensorParallel:
    """Join the group as ``rank`` (rank 0 passes the store it created, the others its port)."""
    if dist.is_initialized():
        raise ProcessGroupError("this process already belongs to a torch.distributed group (one tensor-parallel engine per process)")
    set_collective_env()
    if store is None:
        store = dist.TCPStore(HOST, port, size, is_master=False, timeout=TIMEOUT)
    kwargs = {"device_id": device} if device.type == "cuda" else {}  # NCCL connects now, not inside a capture
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=TIMEOUT, **kwargs)
    return TensorParallel(rank, size, dist.group.WORLD.group_name)


def leave(abort: bool = False) -> None:
    """Destroy this process's group; ``abort`` (NCCL only) also ends collectives stuck on a dead rank."""
    if not dist.is_initialized():
        return
    if abort and dist.get_backend() == "nccl":
        try:
            dist.distributed_c10d._abort_process_group()
            return
        except Exception:  # fall back to destroying it
            pass
    dist.destroy_process_group()
