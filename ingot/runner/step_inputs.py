"""StepInputs: the device tensors one forward needs, built from a scheduled batch."""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from ingot.engine.scheduler import ScheduledBatch
from ingot.layers.attention import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows of the hidden states to turn into logits
    sample_rows: list[int]  # which batch rows those S logits belong to

    @property
    def num_seqs(self) -> int:
        return self.attn.seq_lens.shape[0]


def build_step_inputs(batch: ScheduledBatch, block_size: int, device: torch.device) -> StepInputs:
    """Flatten the batch's new tokens; host lists first, one copy per tensor."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    cu = [0]
    logits_indices: list[int] = []
    sample_rows: list[int] = []
    tables = [seq.block_ids for seq in batch.seqs]
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        end = start + n
        ids.extend(seq.tokens(start, end))
        positions.extend(range(start, end))
        for pos in range(start, end):
            slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(end)
        cu.append(cu[-1] + n)
        if batch.samples(row):
            logits_indices.append(cu[-1] - 1)
            sample_rows.append(row)
    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    attn = AttentionMetadata(
        is_prefill=batch.is_prefill,
        slot_mapping=tensor(slots, torch.int64),
        block_tables=padded_block_table(tables).to(device, non_blocking=True),
        seq_lens=tensor(seq_lens, torch.int32),
        cu_seqlens_q=tensor(cu, torch.int32) if batch.is_prefill else None,
    )
    return StepInputs(
        input_ids=tensor(ids, torch.int64),
        positions=tensor(positions, torch.int64),
        attn=attn,
        logits_indices=tensor(logits_indices, torch.int64),
        sample_rows=sample_rows,
    )


def padded_block_table(tables: list[array.array]) -> torch.Tensor:
    """int32 [B, longest] block table, rows padded with 0 (the dummy block).

    Sequences keep their block ids in int32 arrays, so each row is a memcpy
    into one flat buffer: ``torch.tensor`` of nested lists took 3.1 ms per
    decode step at batch 256 with 600-1,500-token contexts on the CPU (this
    path: 0.1 ms), about as long as the H200 takes for the whole 1.5B step.
    """
    rows = len(tables)
    width = max((len(t) for t in tables), default=0)
    if rows * width == 0:
        return torch.zeros(rows, width, dtype=torch.int32)
    flat = array.array("i", bytes(4 * rows * width))
    for i, t in enumerate(tables):
        flat[i * width : i * width + len(t)] = t if isinstance(t, array.array) else array.array("i", t)
    return torch.frombuffer(flat, dtype=torch.int32).view(rows, width)
