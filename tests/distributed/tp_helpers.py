"""Helpers of the tensor-parallel tests (a module of its own: spawned workers import the
functions ``Executor.run_on_ranks`` sends them from here)."""

from __future__ import annotations

import itertools
import os
from typing import Optional

import torch

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.runner.graph_runner import make_decode_forward
from ingot.runner.model_runner import ModelRunner
from ingot.runner.step_inputs import HostStep, device_inputs, host_step
from ingot.sampling_params import SamplingParams

# Set in the test process, inherited by the spawned workers: "RANK" makes that rank's loading raise
# (``tests/distributed/faults/sitecustomize.py``, put on PYTHONPATH by the test).
FAULT_ENV = "INGOT_TEST_LOAD_FAULT_RANK"
FAULT_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (read from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def tp_engine(model: str, device: str = "cpu", **overrides) -> Engine:
    """An fp32 engine over ``model`` (``tensor_parallel_size`` and the rest in ``overrides``)."""
    return Engine(EngineConfig.create(model=model, device=device, dtype="float32", show_progress=False, **overrides))


def raw_logits(runner: ModelRunner, host: HostStep) -> torch.Tensor:
    """The raw forward's logits of a step, on every rank (the driver's come back)."""
    return runner.raw_logits(device_inputs(host, runner.device))


def decode_graphs(runner: ModelRunner) -> Optional[dict[int, tuple[bool, bool]]]:
    """A rank's decode graphs: bucket -> (a real graph was captured, it replays the compiled forward)."""
    if runner.graphs is None:
        return None
    return {size: (e.graph is not None, e.compiled) for size, e in runner.graphs.entries.items()}


def fail_in_forward(runner: ModelRunner, rank: int, after: int) -> None:
    """Rank ``rank``'s model raises from its ``after + 1``-th forward on."""
    if runner.tp.rank != rank:
        return
    calls = itertools.count()
    forward = runner.model.forward

    def faulty(*args, **kwargs):
        if next(calls) >= after:
            raise RuntimeError(f"injected fault on rank {rank} in forward (pid {os.getpid()})")
        return forward(*args, **kwargs)

    runner.model.forward = faulty


def compile_decode_forward(runner: ModelRunner, host: HostStep) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
    """On every rank: the raw logits of a decode step, the same through the decode forward
    compiled with ``fullgraph=True`` (a recording backend), and each graph's call targets."""
    inputs = device_inputs(host, runner.device)
    raw = runner.raw_logits(inputs).clone()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    forward = torch.compile(make_decode_forward(runner.model, runner.policy), backend=backend, fullgraph=True)
    a = inputs.attn
    with torch.inference_mode():
        compiled = forward(inputs.input_ids, inputs.positions, a.slot_mapping, a.block_tables, a.seq_lens)
    targets = [[str(n.target) for n in gm.graph.nodes if n.op == "call_function"] for gm in graphs]
    return raw, compiled, targets


def teacher_forced_logits(engine: Engine, prompts: list[list[int]], steps: int,
                          forced: Optional[list[list[int]]] = None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Logits of every step (prefill chunks' last tokens, then each decode step) of ``prompts``
    decoded together, through the raw forward on every rank; the next tokens are ``forced``
    (per prompt) or the argmax. Returns (logits per step, tokens fed per prompt)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    fed: list[list[int]] = [[] for _ in prompts]
    index = {id(s): i for i, s in enumerate(seqs)}
    out = []
    while any(len(f) < steps for f in fed):
        batch = engine.scheduler.schedule()
        host = host_step(batch, engine.config.block_size)
        logits = engine.executor.run_on_ranks(raw_logits, host).float().cpu()
        out.append(logits)
        engine.scheduler.on_step_done(batch, engine.scheduler.on_step_launched(batch))  # counts the computed tokens (and caches full blocks)
        for k, row in enumerate(host.sample_rows):
            seq = batch.seqs[row]
            i = index[id(seq)]
            token = forced[i][len(fed[i])] if forced is not None else int(logits[k].argmax())
            fed[i].append(token)
            seq.output_token_ids.append(token)
    for seq in seqs:
        engine.abort(seq.request_id)
    return out, fed
