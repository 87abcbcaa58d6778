"""Helpers of the tensor-parallel tests (a module of its own: spawned workers import FaultySource)."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.loading.checkpoint import open_checkpoint
from ingot.runner.model_source import CheckpointSource
from ingot.runner.tp_runner import start_tensor_parallel
from ingot.sampling_params import SamplingParams


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (read from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def tp_engine(model: str, source=None, device: str = "cpu", **overrides) -> Engine:
    """An fp32 engine over ``model`` whose ranks build their shards from ``source`` (default: the checkpoint)."""
    config = EngineConfig.create(model=model, device=device, dtype="float32", show_progress=False, **overrides)
    ckpt = open_checkpoint(model)
    max_len = config.max_model_len or ckpt.config.max_position_embeddings
    runner = start_tensor_parallel(config, source or CheckpointSource(model), ckpt.config, torch.device(device),
                                   torch.float32, max_len)
    return Engine(config, runner.model, ckpt.config, ckpt.tokenizer, runner.device, torch.float32, max_len, runner=runner)


def teacher_forced_logits(engine: Engine, prompts: list[list[int]], steps: int,
                          forced: Optional[list[list[int]]] = None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Logits of every step (prefill chunks' last tokens, then each decode step) of ``prompts``
    decoded together, through the runner's stage / logits_of; the next tokens are ``forced``
    (per prompt) or the argmax. Returns (logits per step, tokens fed per prompt)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    fed: list[list[int]] = [[] for _ in prompts]
    index = {id(s): i for i, s in enumerate(seqs)}
    out = []
    while any(len(f) < steps for f in fed):
        batch = engine.scheduler.schedule()
        inputs = engine.runner.stage(batch)
        logits = engine.runner.logits_of(None, inputs).float().cpu()
        out.append(logits)
        engine.scheduler.on_step_done(batch, engine.scheduler.on_step_launched(batch))  # counts the computed tokens (and caches full blocks)
        for k, row in enumerate(inputs.sample_rows):
            seq = batch.seqs[row]
            i = index[id(seq)]
            token = forced[i][len(fed[i])] if forced is not None else int(logits[k].argmax())
            fed[i].append(token)
            seq.output_token_ids.append(token)
    for seq in seqs:
        engine.abort(seq.request_id)
    return out, fed


@dataclass(frozen=True)
class FaultySource:
    """A checkpoint whose rank ``rank`` raises while loading (``at="load"``) or in its
    ``after + 1``-th forward (``at="forward"``)."""

    model: str
    rank: int
    at: str
    after: int = 0

    def load(self, tp, device, dtype, max_position, progress=False):
        if tp.rank == self.rank and self.at == "load":
            raise RuntimeError(f"injected fault on rank {tp.rank} while loading")
        model = CheckpointSource(self.model).load(tp, device, dtype, max_position, progress)
        if tp.rank == self.rank and self.at == "forward":
            calls = itertools.count()
            forward = model.forward

            def faulty(*args, **kwargs):
                if next(calls) >= self.after:
                    raise RuntimeError(f"injected fault on rank {tp.rank} in forward (pid {os.getpid()})")
                return forward(*args, **kwargs)

            model.forward = faulty
        return model
