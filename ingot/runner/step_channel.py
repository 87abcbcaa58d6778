"""StepChannel: a step's inputs reach every tensor-parallel rank in one broadcast.

Rank 0 (the driver) packs a step (a header of counts, then the int64 fields,
then the int32 fields, each field aligned like ``step_inputs._packed``) into
one byte buffer on its device and broadcasts the whole buffer; every rank then
takes the same views of it as its ``StepInputs``. The buffer's size is fixed
per engine, from the largest step the configuration allows
(``capacity_for``), so a rank knows what to receive without a second message;
a worker reads the header back to the host to learn the step's shape. The
header also carries what to do: run a step, a call (a pickled function and its
arguments follow), or stop.

Header (int64): kind, is_prefill, tokens T, sampled rows S, sequences
B, block-table width W, prompt-logprob spans P, store_first (a verify step's
rows). Fields: spans [2P], ids [T],
positions [T], slots [T], logits indices [S] (int64); sequence lengths [B],
block table [B * W], cu_seqlens [B + 1] for prefill (int32).
"""

from __future__ import annotations

import array
import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ingot.config import EngineConfig
from ingot.distributed.collectives import broadcast_
from ingot.distributed.parallel import TensorParallel
from ingot.layers.attention import AttentionMetadata
from ingot.runner.step_inputs import HostStep, StepInputs

HEADER = 16  # int64 slots
_ALIGN64, _ALIGN32 = 16, 16  # elements per field alignment (128 / 64 bytes)
_ZEROS = [0] * 16
Span = tuple[int, int]


class Kind(enum.IntEnum):
    STEP = 1  # run_model: a step of the engine
    CALL = 2  # a function to run on every rank follows as a pickled object
    STOP = 3  # the worker leaves its loop


@dataclass(frozen=True)
class Layout:
    """Byte offsets of every field of one step in the buffer."""

    is_prefill: bool
    tokens: int
    sampled: int
    seqs: int
    width: int
    spans: int
    store_first: bool = False

    def header(self, kind: Kind) -> list[int]:
        return [int(kind), int(self.is_prefill), self.tokens, self.sampled, self.seqs, self.width, self.spans,
                int(self.store_first)] + [0] * (HEADER - 8)

    @classmethod
    def from_header(cls, h: Sequence[int]) -> "Layout":
        return cls(bool(h[1]), h[2], h[3], h[4], h[5], h[6], bool(h[7]))

    @property
    def counts64(self) -> list[int]:  # spans, ids, positions, slots, logits indices
        return [2 * self.spans, self.tokens, self.tokens, self.tokens, self.sampled]

    @property
    def counts32(self) -> list[int]:  # seq lens, block table, cu_seqlens
        return [self.seqs, self.seqs * self.width, self.seqs + 1 if self.is_prefill else 0]

    def offsets(self) -> tuple[list[int], list[int], int]:
        """(int64 field starts, int32 field starts) in bytes, and the total size."""
        pos = HEADER * 8
        starts64, starts32 = [], []
        for n in self.counts64:
            starts64.append(pos)
            pos += 8 * _padded(n, _ALIGN64)
        for n in self.counts32:
            starts32.append(pos)
            pos += 4 * _padded(n, _ALIGN32)
        return starts64, starts32, pos


def _padded(n: int, align: int) -> int:
    return n + (-n % align)


def capacity_for(config: EngineConfig, max_blocks_per_seq: int) -> int:
    """Bytes of the largest step ``config`` allows: a prefill of ``max_num_batched_tokens``
    (or a decode of ``max_num_seqs``) over ``max_num_seqs`` sequences of full block tables,
    every one sampling and asking for prompt logprobs, or a verify step of
    ``max_verify_rows`` rows (a block table row and logits each)."""
    seqs = config.max_num_seqs
    tokens = max(config.max_num_batched_tokens, seqs)
    step = Layout(True, tokens, seqs, seqs, max_blocks_per_seq, seqs).offsets()[2]
    rows = config.max_verify_rows
    return max(step, Layout(False, rows, rows, rows, max_blocks_per_seq, 0, True).offsets()[2])


class StepChannel:
    """The step buffer of one rank and the broadcast that fills it."""

    def __init__(self, capacity: int, tp: TensorParallel, device: torch.device) -> None:
        self.tp = tp
        self.device = device
        self.buffer = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self.command = Kind.STOP  # what the buffer's header says now (driver)

    # ------------------------------------------------------------------ driver
    def stage(self, host: HostStep, spans: Sequence[Span], kind: Kind = Kind.STEP) -> StepInputs:
        """Copy a step into this rank's buffer (not sent yet); its inputs as views of the buffer."""
        layout = Layout(host.is_prefill, len(host.ids), len(host.logits_indices), len(host.seq_lens), host.width, len(spans),
                        host.store_first)
        starts64, starts32, size = layout.offsets()
        if size > self.buffer.numel():
            raise ValueError(f"a step of {size} bytes does not fit the {self.buffer.numel()}-byte step buffer")
        flat64 = array.array("q", layout.header(kind))
        for field in ([x for span in spans for x in span], host.ids, host.positions, host.slots, host.logits_indices):
            flat64.extend(field)
            flat64.extend(_ZEROS[: -len(field) % _ALIGN64])
        flat32 = array.array("i")
        for field in (host.seq_lens, host.table, host.cu_seqlens if host.is_prefill else []):
            flat32.extend(field)
            flat32.extend(_ZEROS[: -len(field) % _ALIGN32])
        flat64.frombytes(flat32.tobytes())  # whole int64 slots: the int32 fields are padded to 16
        # one copy from pageable memory: it returns once the host arrays have been read
        data = torch.frombuffer(flat64, dtype=torch.uint8)
        self.buffer[: data.numel()].copy_(data, non_blocking=True)
        self.command = kind
        return self._views(layout, host.sample_rows)

    def send(self, kind: Kind) -> None:
        """Broadcast the buffer as command ``kind`` (the staged step stays as it is)."""
        if self.command != kind:
            self.buffer[:8].copy_(torch.tensor([int(kind)], dtype=torch.int64).view(torch.uint8))
            self.command = kind
        broadcast_(self.buffer, self.tp)

    # ------------------------------------------------------------------ workers
    def receive(self) -> tuple[Kind, Optional[StepInputs], list[Span]]:
        """Wait for the driver's next message: (kind, the step's inputs, its spans)."""
        broadcast_(self.buffer, self.tp)
        head = self.buffer[: HEADER * 8].view(torch.int64).tolist()  # waits for the broadcast
        kind = Kind(head[0])
        if kind is not Kind.STEP:
            return kind, None, []
        layout = Layout.from_header(head)
        inputs = self._views(layout, list(range(layout.sampled)))  # workers only need how many rows sample
        spans: list[Span] = []
        if layout.spans:
            start = layout.offsets()[0][0]
            flat = self.buffer[start : start + 16 * layout.spans].view(torch.int64).tolist()
            spans = list(zip(flat[0::2], flat[1::2]))
        return kind, inputs, spans

    # ------------------------------------------------------------------ both
    def _views(self, layout: Layout, sample_rows: list[int]) -> StepInputs:
        starts64, starts32, _ = layout.offsets()
        _, ids, positions, slots, logits = (
            self.buffer[s : s + 8 * n].view(torch.int64) for s, n in zip(starts64, layout.counts64)
        )
        seq_lens, table, cu = (self.buffer[s : s + 4 * n].view(torch.int32) for s, n in zip(starts32, layout.counts32))
        attn = AttentionMetadata(
            is_prefill=layout.is_prefill,
            slot_mapping=slots,
            block_tables=table.view(layout.seqs, layout.width),
            seq_lens=seq_lens,
            cu_seqlens_q=cu if layout.is_prefill else None,
            store_first=layout.store_first,
        )
        return StepInputs(ids, positions, attn, logits, sample_rows)
