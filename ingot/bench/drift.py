"""Drift check: does graph / compiled-graph decode match eager decode?

Two ways, per bucket:
* teacher-forced: every mode gets the same token at every step (the reference
  mode's greedy choice), so differences do not compound. Reports top-1
  agreement, the largest relative logit error, and the largest difference of
  the chosen token's logprob. Modes replay on the same KV cache; the reference
  mode runs last at each step, so every mode reads history written by it.
* free-running greedy: each mode decodes on its own; reports how many
  sequences are identical to the reference and where each first diverges.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.runner.graph_runner import DecodeGraphRunner
from ingot.runner.kv_pool import blocks_for
from ingot.runner.model_runner import ModelRunner
from ingot.runner.step_inputs import HostStep, device_inputs, host_step
from ingot.sampling_params import SamplingParams

Mode = str  # "eager" | "graph" | "compiled"
MODES: tuple[Mode, ...] = ("eager", "graph", "compiled")


@dataclass
class TeacherForced:
    mode: Mode
    reference: Mode
    bucket: int
    steps: int
    top1_agreement: float
    max_rel_logit_err: float
    mean_rel_logit_err: float
    max_logprob_diff: float
    bitwise_equal: bool


@dataclass
class FreeRunning:
    mode: Mode
    reference: Mode
    bucket: int
    identical: int
    total: int
    token_agreement: float
    first_divergence: list[Optional[int]] = field(default_factory=list)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token (length mismatch counts), None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_free_running(mode: Mode, reference: Mode, bucket: int, got: list[list[int]], ref: list[list[int]]) -> FreeRunning:
    firsts = [first_divergence(g, r) for g, r in zip(got, ref)]
    same = sum(1 for g, r in zip(got, ref) for x, y in zip(g, r) if x == y)
    total = sum(len(r) for r in ref)
    return FreeRunning(mode, reference, bucket, sum(f is None for f in firsts), len(ref), same / max(total, 1), firsts)


# Decode graphs of each mode, per process (every rank builds its own: ``Executor.run_on_ranks``).
_VARIANTS: dict[int, Optional[DecodeGraphRunner]] = {}
_ENGINE_GRAPHS = -1  # where the engine's own graphs wait while a mode serves


def _build(runner: ModelRunner, vid: int, config: EngineConfig, max_blocks: int) -> bool:
    """Capture mode ``vid``'s decode graphs on this rank; whether they replay a compiled forward."""
    graphs = DecodeGraphRunner(runner.model, config, runner.device, max_blocks, runner.policy, runner.tp)
    graphs.capture_all()
    _VARIANTS[vid] = graphs
    return graphs.compiled


def _drop(runner: ModelRunner, vid: int) -> None:
    _VARIANTS.pop(vid, None)
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()


def _logits(runner: ModelRunner, host: HostStep, vids: list[Optional[int]]) -> list[torch.Tensor]:
    """The staged step's logits replayed by each mode in turn (None: the raw forward), in fp32."""
    inputs = device_inputs(host, runner.device)
    out = []
    for vid in vids:
        graphs = _VARIANTS.get(vid) if vid is not None else None
        logits = graphs.run(inputs) if graphs is not None else runner.raw_logits(inputs)
        out.append(logits.float().clone())
    return out


def _serve_with(runner: ModelRunner, vid: Optional[int]) -> None:
    """Engine steps decode with mode ``vid`` (None: eager); ``_ENGINE_GRAPHS`` restores the engine's own."""
    if vid == _ENGINE_GRAPHS:
        runner.graphs = _VARIANTS.pop(_ENGINE_GRAPHS, None)
        return
    if _ENGINE_GRAPHS not in _VARIANTS:
        _VARIANTS[_ENGINE_GRAPHS] = runner.graphs
    runner.graphs = _VARIANTS.get(vid) if vid is not None else None


class DecodeModes:
    """One decode forward per mode on an engine's model and KV cache, built on every rank
    through ``Executor.run_on_ranks`` (so a tensor-parallel engine builds them on every rank)."""

    def __init__(self, engine: Engine, bucket: int) -> None:
        self.engine = engine
        self.bucket = bucket
        self.ids: dict[Mode, Optional[int]] = {"eager": None}
        base = engine.config.replace(cudagraph_capture_sizes=(bucket,), max_num_seqs=max(bucket, engine.config.max_num_seqs),
                                     eager_mode=False, show_progress=False)
        max_blocks = blocks_for(engine.max_model_len, engine.config.block_size)
        run = engine.executor.run_on_ranks
        for vid, (mode, compile_on) in enumerate((("graph", False), ("compiled", True))):
            compiled = run(_build, vid, base.replace(decode_compile=compile_on), max_blocks)
            if compile_on and not compiled:
                run(_drop, vid)
                continue  # compile unavailable here (CPU): skip the mode
            self.ids[mode] = vid

    @property
    def modes(self) -> list[Mode]:
        return list(self.ids)

    def logits(self, modes: Sequence[Mode], host: HostStep) -> list[torch.Tensor]:
        """Each mode's logits of the step, in the order given."""
        return self.engine.executor.run_on_ranks(_logits, host, [self.ids[m] for m in modes])

    @contextlib.contextmanager
    def serving(self, mode: Mode) -> Iterator[None]:
        """Let the engine's own step loop decode with ``mode``."""
        run = self.engine.executor.run_on_ranks
        run(_serve_with, self.ids[mode])
        try:
            yield
        finally:
            run(_serve_with, _ENGINE_GRAPHS)

    def close(self) -> None:
        """Free the modes' graphs."""
        for vid in self.ids.values():
            if vid is not None:
                self.engine.executor.run_on_ranks(_drop, vid)
        self.ids = {"eager": None}


def prefill(engine: Engine, prompts: list[list[int]], steps: int) -> list:
    """Add ``prompts`` (greedy, room for ``steps`` decode steps after the first token) and step
    until each has its first token; their sequences. On an engine that overlaps steps a decode
    step queued behind the prefill is still in flight (``Sequence.num_pending``) when the
    caller schedules its own steps, which then repeat the first token once."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(not s.output_token_ids for s in seqs):
        engine.step()  # prefill steps come first while any prompt is waiting
    return seqs


def prompt_groups(prompts: list[list[int]], size: int) -> Iterator[list[list[int]]]:
    """``prompts`` ``size`` at a time (the last group may be smaller)."""
    for i in range(0, len(prompts), size):
        yield prompts[i : i + size]


def teacher_forced(modes: DecodeModes, prompts: list[list[int]], steps: int, reference: Mode = "graph") -> list[TeacherForced]:
    """Prompts run in groups of the bucket size, so every decode step fills the bucket."""
    others = [m for m in modes.modes if m != reference]
    agree = {m: 0 for m in others}
    rel: dict[Mode, list[float]] = {m: [] for m in others}
    lp_diff = {m: 0.0 for m in others}
    bitwise = {m: True for m in others}
    count = 0
    for group in prompt_groups(prompts, modes.bucket):
        count += _teacher_forced_group(modes, group, steps, reference, others, agree, rel, lp_diff, bitwise)
    return [
        TeacherForced(m, reference, modes.bucket, steps, agree[m] / count, max(rel[m]), sum(rel[m]) / len(rel[m]), lp_diff[m], bitwise[m])
        for m in others
    ]


def _teacher_forced_group(modes, prompts, steps, reference, others, agree, rel, lp_diff, bitwise) -> int:
    engine = modes.engine
    seqs = prefill(engine, prompts, steps)
    count = 0
    for _ in range(steps):
        batch = engine.scheduler.schedule()
        assert batch is not None and not batch.is_prefill and len(batch.seqs) == len(seqs)
        *logits, ref = modes.logits([*others, reference], host_step(batch, engine.config.block_size))
        got = dict(zip(others, logits))  # the reference ran last: the cache keeps its K/V
        tokens = ref.argmax(-1)
        ref_lp = torch.log_softmax(ref, -1)
        for m, lg in got.items():
            agree[m] += int((lg.argmax(-1) == tokens).sum())
            rel[m].extend(((lg - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist())
            lp = torch.log_softmax(lg, -1).gather(1, tokens[:, None]) - ref_lp.gather(1, tokens[:, None])
            lp_diff[m] = max(lp_diff[m], float(lp.abs().max()))
            bitwise[m] = bitwise[m] and torch.equal(lg, ref)
        count += len(seqs)
        for seq, tok in zip(batch.seqs, tokens.tolist()):
            seq.num_computed_tokens += 1
            seq.output_token_ids.append(tok)
    for seq in seqs:
        engine.scheduler.finish(seq)
        engine.requests.pop(seq.request_id, None)
    return count


def free_running(modes: DecodeModes, prompts: list[list[int]], steps: int, reference: Mode = "graph") -> list[FreeRunning]:
    engine = modes.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outputs: dict[Mode, list[list[int]]] = {}
    for mode in modes.modes:
        outputs[mode] = []
        with modes.serving(mode):
            for group in prompt_groups(prompts, modes.bucket):
                seqs = [engine.add_request(p, params) for p in group]
                while engine.has_unfinished():
                    engine.step()
                outputs[mode] += [list(s.output_token_ids) for s in seqs]
                for s in seqs:
                    engine.requests.pop(s.request_id, None)
    return [compare_free_running(m, reference, modes.bucket, outputs[m], outputs[reference]) for m in modes.modes if m != reference]


def as_dicts(rows: Sequence[object]) -> list[dict]:
    return [asdict(r) for r in rows]
