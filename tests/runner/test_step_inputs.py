"""StepInputs from a scheduled batch: hand-computed tensors for a prefill and a decode step."""

from __future__ import annotations

import array

import torch

from ingot.runner.batch import ScheduledBatch
from ingot.engine.sequence import Sequence
from ingot.runner.step_inputs import build_step_inputs, last_token_indices, padded_block_rows
from ingot.sampling_params import SamplingParams


def test_padded_block_rows_hand_computed():
    rows, width, flat = padded_block_rows([array.array("i", [7, 3, 9]), [4], array.array("i")])
    assert flat.typecode == "i"  # int32
    assert [flat[i * width : (i + 1) * width].tolist() for i in range(rows)] == [[7, 3, 9], [4, 0, 0], [0, 0, 0]]
    assert padded_block_rows([])[:2] == (0, 0)
    assert padded_block_rows([array.array("i")])[:2] == (1, 0)


def _seq(prompt: list[int], output: list[int], blocks: list[int], computed: int) -> Sequence:
    s = Sequence("r", None, prompt, SamplingParams(), None)
    s.output_token_ids = list(output)
    s.block_ids.extend(blocks)
    s.num_computed_tokens = computed
    return s


def test_decode_step_inputs_hand_computed():
    # block size 4; seq a: 6 prompt + 1 output (position 6, block 2 of [5, 8]); seq b: 3 + 2 (position 4)
    a = _seq([1, 2, 3, 4, 5, 6], [70], [5, 8], 6)
    b = _seq([9, 9, 9], [71, 72], [2, 6], 4)
    inp = build_step_inputs(ScheduledBatch([a, b], False, [1, 1]), 4, torch.device("cpu"))
    assert inp.input_ids.tolist() == [70, 72]
    assert inp.positions.tolist() == [6, 4]
    assert inp.attn.slot_mapping.tolist() == [8 * 4 + 2, 6 * 4 + 0]
    assert inp.attn.block_tables.tolist() == [[5, 8], [2, 6]]
    assert inp.attn.seq_lens.tolist() == [7, 5]
    assert inp.attn.cu_seqlens_q is None and not inp.attn.is_prefill
    assert inp.logits_indices.tolist() == [0, 1] and inp.sample_rows == [0, 1]


def test_prefill_step_inputs_hand_computed():
    # seq a: a 5-token prompt chunked, 3 already computed -> tokens 3..4 (samples);
    # seq b: first 2 of a 6-token prompt (does not sample yet)
    a = _seq([10, 11, 12, 13, 14], [], [3, 7], 3)
    b = _seq([20, 21, 22, 23, 24, 25], [], [1], 0)
    inp = build_step_inputs(ScheduledBatch([a, b], True, [2, 2]), 4, torch.device("cpu"))
    assert inp.input_ids.tolist() == [13, 14, 20, 21]
    assert inp.positions.tolist() == [3, 4, 0, 1]
    assert inp.attn.slot_mapping.tolist() == [3 * 4 + 3, 7 * 4 + 0, 1 * 4 + 0, 1 * 4 + 1]
    assert inp.attn.block_tables.tolist() == [[3, 7], [1, 0]]
    assert inp.attn.seq_lens.tolist() == [5, 2]
    assert inp.attn.cu_seqlens_q.tolist() == [0, 2, 4]
    assert inp.logits_indices.tolist() == [1] and inp.sample_rows == [0]


def test_step_tensors_share_two_buffers_at_aligned_offsets():
    """A step's tensors are views of one int64 and one int32 buffer (two host-to-device
    copies), each starting 16-byte aligned, so kernels never see an unaligned pointer."""
    a = _seq([10, 11, 12, 13, 14], [], [3, 7], 3)
    b = _seq([20, 21, 22], [], [1], 0)
    inp = build_step_inputs(ScheduledBatch([a, b], True, [2, 3]), 4, torch.device("cpu"))
    a64 = [inp.input_ids, inp.positions, inp.attn.slot_mapping, inp.logits_indices]
    a32 = [inp.attn.seq_lens, inp.attn.block_tables, inp.attn.cu_seqlens_q]
    for group in (a64, a32):
        assert len({t.untyped_storage().data_ptr() for t in group}) == 1
        for t in group:
            assert t.is_contiguous() and (t.storage_offset() * t.element_size()) % 16 == 0
    assert inp.attn.cu_seqlens_q.tolist() == [0, 2, 5] and inp.attn.block_tables.tolist() == [[3, 7], [1, 0]]
    empty = build_step_inputs(ScheduledBatch([], False, []), 4, torch.device("cpu"))
    assert empty.input_ids.numel() == 0 and empty.attn.block_tables.shape == (0, 0)


def test_decode_fast_path_equals_the_general_path():
    """The decode-only fields (one pass, no per-token loops) match the general ones."""
    import random

    from ingot.runner.step_inputs import _decode_fields, prefill_rows

    rng = random.Random(0)
    seqs = []
    for _ in range(50):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        output = [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
        n = len(prompt) + len(output)
        blocks = rng.sample(range(1, 500), -(-n // 4))
        seqs.append(_seq(prompt, output, blocks, n - 1))
    batch = ScheduledBatch(seqs, False, [1] * len(seqs))
    general = prefill_rows(seqs, [(s.num_computed_tokens, s.num_tokens) for s in seqs], [True] * len(seqs), 4)
    assert _decode_fields(batch, 4) == (general.ids, general.positions, general.slots, general.seq_lens,
                                        general.cu_seqlens, general.logits_indices, general.sample_rows)


def test_verify_step_is_one_decode_row_per_token_hand_computed():
    """A verify step: seq a (position 6, drafts 40, 41) is rows at positions 6, 7, 8 (block 8's
    slots 2..3, then block 9's slot 0), each over a's block table; seq b without drafts is one
    row. Every row has logits, each sequence samples, and the rows store their K/V first."""
    a = _seq([1, 2, 3, 4, 5, 6], [70], [5, 8, 9], 6)
    b = _seq([9, 9, 9], [71, 72], [2, 6], 4)
    batch = ScheduledBatch([a, b], False, [3, 1], draft_tokens=[[40, 41], []])
    inp = build_step_inputs(batch, 4, torch.device("cpu"))
    assert inp.input_ids.tolist() == [70, 40, 41, 72]
    assert inp.positions.tolist() == [6, 7, 8, 4]
    assert inp.attn.slot_mapping.tolist() == [8 * 4 + 2, 8 * 4 + 3, 9 * 4 + 0, 6 * 4 + 0]
    assert inp.attn.seq_lens.tolist() == [7, 8, 9, 5]
    assert inp.attn.block_tables.tolist() == [[5, 8, 9]] * 3 + [[2, 6, 0]]
    assert not inp.attn.is_prefill and inp.attn.store_first and inp.attn.cu_seqlens_q is None
    assert inp.logits_indices.tolist() == [0, 1, 2, 3] and inp.sample_rows == [0, 1]
    assert last_token_indices(batch) == [0, 3]
    plain = build_step_inputs(ScheduledBatch([a, b], False, [1, 1]), 4, torch.device("cpu"))
    assert not plain.attn.store_first
