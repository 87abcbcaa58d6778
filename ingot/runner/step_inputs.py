"""StepInputs: the device tensors one forward needs, built from a scheduled batch."""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Sequence

import torch

from ingot.runner.batch import BatchSequence, ScheduledBatch
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


@dataclass
class HostStep:
    """The fields of one step on the host, before they are copied to the device."""

    is_prefill: bool
    ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    cu_seqlens: list[int]  # prefill only (a decode step's is not copied)
    logits_indices: list[int]
    sample_rows: list[int]
    rows: int  # block table rows and width; ``table`` is the flat int32 [rows, width]
    width: int
    table: array.array
    store_first: bool = False  # a verify step's rows (``AttentionMetadata.store_first``)


def host_step(batch: ScheduledBatch, block_size: int) -> HostStep:
    if batch.draft_tokens is not None:
        return _verify_step(batch, block_size)
    if batch.is_prefill:
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        spans = [(start, start + n) for start, n in zip(starts, batch.num_new_tokens)]
        return prefill_rows(batch.seqs, spans, [batch.samples(row) for row in range(len(spans))], block_size)
    ids, positions, slots, seq_lens, cu, logits_indices, sample_rows = _decode_fields(batch, block_size)
    rows, width, table = padded_block_rows([seq.block_ids for seq in batch.seqs])
    return HostStep(False, ids, positions, slots, seq_lens, cu, logits_indices, sample_rows, rows, width, table)


def decode_rows(tables: list, ids: list[int], positions: list[int], block_size: int, store_first: bool) -> HostStep:
    """Decode rows, one per (block table, token, position): each writes its K/V to its own
    slot and attends to positions ``[0, position]`` of its table, so a sequence may have
    several rows (with ``store_first``: every row's K/V is stored before any row attends).
    Every row has logits and samples. Speculative decoding's verify steps and the draft
    model's steps are made of them."""
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    n = len(ids)
    rows, width, table = padded_block_rows(tables)
    return HostStep(False, ids, positions, slots, [p + 1 for p in positions], list(range(n + 1)), list(range(n)),
                    list(range(n)), rows, width, table, store_first=store_first)


def build_step_inputs(batch: ScheduledBatch, block_size: int, device: torch.device) -> StepInputs:
    """Flatten the batch's new tokens: host lists first, then one copy per dtype; the
    step's tensors are views of those two device tensors."""
    return device_inputs(host_step(batch, block_size), device)


def device_inputs(h: HostStep, device: torch.device) -> StepInputs:
    """A host step's fields on ``device`` (a HostStep pickles: any rank can build its inputs from one)."""
    # two host-to-device copies per step (the int64 fields, then the int32 ones) instead of
    # six: each copy from pageable memory is its own blocking cudaMemcpy on the host
    input_ids, pos_t, slot_t, logits_t = _packed([h.ids, h.positions, h.slots, h.logits_indices], torch.int64, device)
    int_fields = [h.seq_lens, h.table] + ([h.cu_seqlens] if h.is_prefill else [])
    seq_lens_t, table_t, *cu_t = _packed(int_fields, torch.int32, device)
    attn = AttentionMetadata(
        is_prefill=h.is_prefill,
        slot_mapping=slot_t,
        block_tables=table_t.view(h.rows, h.width),
        seq_lens=seq_lens_t,
        cu_seqlens_q=cu_t[0] if h.is_prefill else None,
        store_first=h.store_first,
    )
    return StepInputs(
        input_ids=input_ids,
        positions=pos_t,
        attn=attn,
        logits_indices=logits_t,
        sample_rows=h.sample_rows,
    )


def prefill_rows(seqs: Sequence[BatchSequence], spans: list[tuple[int, int]], samples: list[bool],
                 block_size: int, shift: int = 0) -> HostStep:
    """Prefill rows: each sequence's tokens ``[start, end)`` of ``spans``, attending to its
    cached K/V before ``start`` too (a chunk); logits at the last token of the rows that
    ``samples`` marks. A prefill step's rows, and a draft model catching up its K/V.
    ``shift``: token ``t`` sits at position ``t + shift`` (an EAGLE head's rows: -1)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    cu = [0]
    logits_indices: list[int] = []
    sample_rows: list[int] = []
    for row, (seq, (start, end)) in enumerate(zip(seqs, spans)):
        ids.extend(seq.tokens(start, end))
        positions.extend(range(start + shift, end + shift))
        for pos in range(start + shift, end + shift):
            slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(end + shift)
        cu.append(cu[-1] + end - start)
        if samples[row]:
            logits_indices.append(cu[-1] - 1)
            sample_rows.append(row)
    rows, width, table = padded_block_rows([seq.block_ids for seq in seqs])
    return HostStep(True, ids, positions, slots, seq_lens, cu, logits_indices, sample_rows, rows, width, table)


def _verify_step(batch: ScheduledBatch, block_size: int) -> HostStep:
    """A verify step (speculative decoding): a sequence with ``k`` drafts is ``k + 1`` decode
    rows (``decode_rows``), its last token then each draft, at consecutive positions, its
    block table row repeated, so decode attention gives each row causal attention over the
    cache. Every row has logits; the sequences are the rows that sample."""
    assert batch.draft_tokens is not None
    tables: list = []
    ids: list[int] = []
    positions: list[int] = []
    for seq, drafts in zip(batch.seqs, batch.draft_tokens):
        start = seq.num_computed_tokens
        ids.extend(seq.tokens(start, start + 1))
        ids.extend(drafts)
        positions.extend(range(start, start + 1 + len(drafts)))
        tables.extend([seq.block_ids] * (1 + len(drafts)))
    step = decode_rows(tables, ids, positions, block_size, store_first=True)
    step.sample_rows = list(range(len(batch.seqs)))
    return step


def _decode_fields(batch: ScheduledBatch, block_size: int) -> tuple[list[int], ...]:
    """The same fields for a decode batch, where every row computes its last token and
    samples: one pass without per-token loops (this runs on every step, for every
    running sequence, while the GPU waits)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for seq in batch.seqs:
        pos = seq.num_computed_tokens
        out = seq.output_token_ids
        ids.append(out[-1] if out else seq.prompt_token_ids[-1])
        positions.append(pos)
        slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
    rows = list(range(len(ids)))
    seq_lens = [p + 1 for p in positions]
    return ids, positions, slots, seq_lens, list(range(len(ids) + 1)), rows, rows


def last_token_indices(batch: ScheduledBatch) -> list[int]:
    """Where each row's latest token sits in the step's flattened tokens (what ``TokenFeed``
    fills): its last new token; a verify step's first row of each sequence (drafts follow it)."""
    if batch.draft_tokens is not None:
        starts, row = [], 0
        for drafts in batch.draft_tokens:
            starts.append(row)
            row += 1 + len(drafts)
        return starts
    if not batch.is_prefill:
        return list(range(len(batch.seqs)))
    out, end = [], 0
    for n in batch.num_new_tokens:
        end += n
        out.append(end - 1)
    return out


_ALIGN = 16  # elements: every field starts at a multiple of 64 / 128 bytes
_ZEROS = [0] * _ALIGN


def _packed(fields: list, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Views of one device tensor holding ``fields`` (int sequences) back to back, made
    with one copy. Fields start at aligned offsets, so a Triton kernel given a view always
    sees a 16-byte-aligned pointer (an unaligned one would compile another variant)."""
    flat = array.array("q" if dtype == torch.int64 else "i")
    starts = []
    for field in fields:
        starts.append(len(flat))
        flat.extend(field)
        flat.extend(_ZEROS[: -len(field) % _ALIGN])
    if not flat:
        return [torch.empty(0, dtype=dtype, device=device) for _ in fields]
    buf = torch.frombuffer(flat, dtype=dtype).to(device, non_blocking=True)
    return [buf[start : start + len(field)] for start, field in zip(starts, fields)]


def padded_block_rows(tables: list) -> tuple[int, int, array.array]:
    """(rows, width, the int32 [rows, width] block table flattened), rows padded with 0
    (the dummy block).

    Sequences keep their block ids in int32 arrays, so each row is a memcpy
    into one flat buffer: ``torch.tensor`` of nested lists costs about 30x
    more host time per decode step at batch 256 with 600-1,500-token contexts,
    as long as a GPU takes for a whole step of a 1.5B model.
    """
    rows = len(tables)
    width = max((len(t) for t in tables), default=0)
    flat = array.array("i", bytes(4 * rows * width))
    for i, t in enumerate(tables):
        flat[i * width : i * width + len(t)] = t if isinstance(t, array.array) else array.array("i", t)
    return rows, width, flat
