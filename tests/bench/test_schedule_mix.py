"""benchmarks/schedule_mix.py counts the steps a workload becomes: checked on workloads small
enough to count by hand."""

from __future__ import annotations

from benchmarks.schedule_mix import simulate
from ingot.bench.serve import Workload


def test_one_prefill_then_full_decode_steps():
    # 4 prompts of 8 tokens fit one prefill step (which samples each first token); 6 tokens each
    r = simulate(Workload(4, (8, 8), (6, 6)), max_num_seqs=8, max_num_batched_tokens=4096, prefix_caching=True)
    assert (r["prefill_steps"], r["small_prefill_steps"], r["prefill_tokens"]) == (1, 1, 32)
    assert (r["decode_steps"], r["mean_decode_batch"], r["decode_steps_under_64"]) == (5, 4.0, 5)


def test_a_freed_slot_admits_the_next_prompt_in_its_own_prefill_step():
    # two slots, three requests of 3 tokens: the third is prefilled alone once one finishes
    r = simulate(Workload(3, (8, 8), (3, 3)), max_num_seqs=2, max_num_batched_tokens=4096, prefix_caching=False)
    # prefill {0,1} -> decode x2 (both finish) -> prefill {2} -> decode x2
    assert (r["prefill_steps"], r["prefill_tokens"], r["decode_steps"], r["mean_decode_batch"]) == (2, 24, 4, 1.5)
