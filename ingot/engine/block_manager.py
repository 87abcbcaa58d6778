"""Which KV blocks each sequence holds: the engine's side of the paged KV cache.

The tensors live in the runner (``runner/kv_pool.py``); this manager only hands
out block ids. Block 0 (``DUMMY_BLOCK``) is never handed out: it is the
padding target of captured decode batches.
"""

from __future__ import annotations

from collections import deque

from ingot.engine.sequence import Sequence
from ingot.runner.kv_pool import DUMMY_BLOCK, blocks_for


class BlockManager:
    """Free-list allocator of KV blocks (ids 1..num_blocks-1)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 2, "need at least one usable block besides the dummy"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(DUMMY_BLOCK + 1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could ever hold: every usable block."""
        return (self.num_blocks - 1) * self.block_size

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs so that ``num_tokens`` of its tokens fit."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_ids))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.extra_blocks(seq, num_tokens)
        assert need <= self.num_free, "caller must check can_grow first"
        seq.block_ids.extend(self.free_blocks.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_ids)
        del seq.block_ids[:]
