"""Speculative drift check (``ingot check drift --speculative-config JSON``): does greedy
decoding with speculation give plain greedy decoding's tokens?

One engine, built with the speculation and otherwise as it serves (decode graphs on CUDA,
compile off; prefix caching off, so every run prefills its prompts itself). Per bucket (the
prompts decoded that many at a time):

* free-running: every prompt decoded greedily plainly (the speculation switched off,
  ``speculation_off``) and speculating; per prompt the first divergence, and the share of
  identical tokens, position by position (one divergence changes every token after it).
* teacher-forced: plain decode steps (the engine's own decode forward: its graph where one
  is captured) fed the speculative output token by token; the share of positions where plain
  greedy decoding picks the speculative token, and the largest logprob gap between its pick
  and that token. Greedy verification keeps a draft only where it is the argmax, so this is
  100% up to ties and the numerics that differ between the verify forward (several query
  tokens per sequence) and the decode forward; a divergence counts once, where it happens.
  The pass threshold applies to it, as to the decode modes' teacher-forced agreement.

Speculation's drafts and kept tokens (``RequestOutput.metrics``, summed) are reported; a
bucket in which nothing was drafted fails, since it compared nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch

from ingot.bench import report
from ingot.bench.drift import compare_free_running, prefill, prompt_groups
from ingot.bench.serve import SpecCounts
from ingot.bench.speculation import speculation_off
from ingot.runner.model_runner import ModelRunner
from ingot.runner.step_inputs import HostStep, device_inputs, host_step
from ingot.sampling_params import SamplingParams


@dataclass
class SpeculativeDrift:
    """One bucket: speculative greedy decoding against plain greedy decoding."""

    bucket: int
    steps: int
    identical: int  # prompts whose whole output is plain decoding's
    total: int
    token_agreement: float  # identical tokens, position by position
    first_divergence: list[Optional[int]]
    teacher_forced_agreement: float  # plain greedy picks the speculative token, given the speculative history
    max_logprob_gap: float  # plain decoding's logprob of its pick minus that of the speculative token, worst position
    spec: SpecCounts = field(default_factory=SpecCounts)

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.spec.fields()["spec_acceptance_rate"]

    def passed(self, threshold: float) -> bool:
        return self.spec.drafts > 0 and self.teacher_forced_agreement >= threshold

    def to_json(self, threshold: float) -> dict[str, Any]:
        out = asdict(self)
        del out["spec"]
        return {**out, **self.spec.fields(), "passed": self.passed(threshold)}


def greedy_outputs(engine: Any, prompts: list[list[int]], steps: int, bucket: int) -> tuple[list[list[int]], SpecCounts]:
    """Every prompt's ``steps`` greedy tokens, ``bucket`` prompts at a time, with the engine as
    it is (speculating or not), and the speculation counts of their final outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outputs: list[list[int]] = []
    counts = SpecCounts()
    for group in prompt_groups(prompts, bucket):
        seqs = [engine.add_request(p, params) for p in group]
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    counts += SpecCounts.of(out.metrics)
        outputs += [list(s.output_token_ids) for s in seqs]
    return outputs, counts


@torch.inference_mode()
def _decode_logits(runner: ModelRunner, host: HostStep) -> torch.Tensor:
    """The step's logits from the engine's own decode forward (graph replay where it fits), fp32."""
    return runner.forward_logits(device_inputs(host, runner.device)).float().clone()


def plain_agreement(engine: Any, prompts: list[list[int]], forced: list[list[int]], bucket: int) -> tuple[int, int, float]:
    """Plain decoding fed ``forced`` (each prompt's tokens): (positions where its greedy pick is
    the forced token, positions, the largest logprob gap between its pick and the forced token).
    The first token comes from the prefill, the rest from decode steps."""
    agree, total, gap = 0, 0, 0.0
    for group, wanted in zip(prompt_groups(prompts, bucket), prompt_groups(forced, bucket)):
        steps = len(wanted[0])
        seqs = prefill(engine, group, steps)
        assert all(len(s.output_token_ids) == 1 and not s.num_pending for s in seqs), \
            "the group's prompts prefill in one step, on an engine that does not overlap steps"
        forced_of = {id(s): w for s, w in zip(seqs, wanted)}
        for s, w in zip(seqs, wanted):
            agree += s.output_token_ids[0] == w[0]
            total += 1
            s.output_token_ids[0] = w[0]
        for j in range(1, steps):
            batch = engine.scheduler.schedule()
            assert batch is not None and not batch.is_prefill and len(batch.seqs) == len(seqs)
            logits = engine.executor.run_on_ranks(_decode_logits, host_step(batch, engine.config.block_size))
            logprobs = torch.log_softmax(logits, -1)
            tokens = [forced_of[id(s)][j] for s in batch.seqs]
            chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0]
            best = logprobs.max(-1)
            agree += int((best.indices.cpu() == torch.tensor(tokens)).sum())
            total += len(tokens)
            gap = max(gap, float((best.values - chosen).max()))
            for seq, tok in zip(batch.seqs, tokens):
                seq.num_computed_tokens += 1
                seq.output_token_ids.append(tok)
        for seq in seqs:
            engine.scheduler.finish(seq)
            engine.requests.pop(seq.request_id, None)
    return agree, total, gap


def check_bucket(engine: Any, prompts: list[list[int]], steps: int, bucket: int) -> SpeculativeDrift:
    """Plain and speculative greedy decoding of ``prompts`` at ``bucket``, compared."""
    with speculation_off(engine):
        plain, _ = greedy_outputs(engine, prompts, steps, bucket)
    speculative, counts = greedy_outputs(engine, prompts, steps, bucket)
    free = compare_free_running("speculative", "plain", bucket, speculative, plain)
    with speculation_off(engine):
        agree, total, gap = plain_agreement(engine, prompts, speculative, bucket)
    return SpeculativeDrift(bucket, steps, free.identical, free.total, free.token_agreement, free.first_divergence,
                            agree / max(total, 1), gap, counts)


def bucket_table(rows: Sequence[SpeculativeDrift], threshold: float, label: str):
    """One row per bucket: speculative decoding against plain decoding."""
    columns = ["bucket", "teacher-forced", "max logprob gap", "identical outputs", "identical tokens",
               "first divergence", "drafts", "acceptance", "mean accepted"]
    cells = []
    for r in rows:
        mark = " ok" if r.passed(threshold) else " FAIL"
        firsts = [str(f) for f in r.first_divergence if f is not None]
        spec = r.spec.fields()
        cells.append([str(r.bucket), f"{100 * r.teacher_forced_agreement:.2f}%{mark}", f"{r.max_logprob_gap:.2e}",
                      f"{r.identical}/{r.total}", f"{100 * r.token_agreement:.2f}%", ", ".join(firsts) or "-",
                      f"{r.spec.drafts:,}", report.fmt(spec["spec_acceptance_rate"], ".1%"),
                      report.fmt(spec["spec_mean_accepted_length"], ".2f")])
    title = f"speculative ({label}) against plain greedy decoding ({rows[0].steps if rows else 0} steps)"
    caption = f"threshold: teacher-forced agreement >= {100 * threshold:.2f}%, and drafts in every bucket"
    return report.make_table(title, columns, cells, right_align=columns, caption=caption)


def failures(rows: Sequence[SpeculativeDrift], threshold: float) -> list[str]:
    """Why each failing bucket fails."""
    out = []
    for r in rows:
        if r.spec.drafts == 0:
            out.append(f"bucket {r.bucket}: speculation proposed no drafts, so nothing was compared (prompts that "
                       "repeat text, or a bucket at most disable_by_batch_size)")
        elif r.teacher_forced_agreement < threshold:
            out.append(f"bucket {r.bucket}: teacher-forced agreement with plain decoding "
                       f"{100 * r.teacher_forced_agreement:.2f}% < {100 * threshold:.2f}%")
    return out
