"""The step buffer of tensor parallelism (one rank here: the broadcast is the identity): what the
driver stages is what a worker reads back from the header and fields, a verify step included."""

from __future__ import annotations

import torch

from ingot.config import EngineConfig
from ingot.distributed.parallel import SINGLE
from ingot.engine.sequence import Sequence
from ingot.runner.batch import ScheduledBatch
from ingot.runner.step_channel import Kind, StepChannel, capacity_for
from ingot.runner.step_inputs import host_step
from ingot.sampling_params import SamplingParams


def _seq(tokens: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence("r", None, tokens, SamplingParams(), None)
    seq.block_ids.extend(blocks)
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def test_a_worker_reads_a_verify_step_as_its_rows():
    """Rows of a verify step (3 + 1 + 5), with their store_first flag, reach a worker as staged."""
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, speculative_config={"method": "ngram",
                                                                                       "num_speculative_tokens": 4})
    channel = StepChannel(capacity_for(config, 4), SINGLE, torch.device("cpu"))
    seqs = [_seq([5, 6, 7, 8, 9], [3]), _seq([1, 2], [1]), _seq(list(range(10, 30)), [2, 4])]
    batch = ScheduledBatch(seqs, False, [3, 1, 5], draft_tokens=[[11, 12], [], [40, 41, 42, 43]])
    host = host_step(batch, 16)
    staged = channel.stage(host, [])
    kind, got, spans = channel.receive()
    assert kind is Kind.STEP and spans == []
    for inputs in (staged, got):
        assert inputs.attn.store_first and not inputs.attn.is_prefill and inputs.attn.cu_seqlens_q is None
        assert inputs.input_ids.tolist() == [9, 11, 12, 2, 29, 40, 41, 42, 43]
        assert inputs.positions.tolist() == [4, 5, 6, 1, 19, 20, 21, 22, 23]
        assert inputs.attn.seq_lens.tolist() == [5, 6, 7, 2, 20, 21, 22, 23, 24]
        assert inputs.attn.block_tables.tolist() == [[3, 0]] * 3 + [[1, 0]] + [[2, 4]] * 5
        assert inputs.logits_indices.tolist() == list(range(9))


def test_the_buffer_holds_the_largest_verify_step():
    """``max_verify_rows`` rows (4 sequences of 1 + 4 tokens), each with a full block table, fit
    a buffer sized for prefills of 8 tokens: a verify step has more rows than any other step."""
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, speculative_config={"method": "ngram",
                                                                                       "num_speculative_tokens": 4})
    channel = StepChannel(capacity_for(config, 8), SINGLE, torch.device("cpu"))
    seqs = [_seq(list(range(100, 200)), list(range(1 + 8 * i, 9 + 8 * i))) for i in range(4)]
    batch = ScheduledBatch(seqs, False, [5] * 4, draft_tokens=[[1, 2, 3, 4]] * 4)
    inputs = channel.stage(host_step(batch, 16), [])
    assert inputs.attn.block_tables.shape == (config.max_verify_rows, 8) == (20, 8)
    plain = StepChannel(capacity_for(config.replace(speculative_config=None), 8), SINGLE, torch.device("cpu"))
    assert plain.buffer.numel() < channel.buffer.numel()
