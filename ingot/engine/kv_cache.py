"""The paged KV cache: one preallocated pool of blocks, and the manager that hands them out.

Block 0 is never handed out: padded rows of a captured decode batch write their
K/V there and attend only to it, so padding can never touch a real sequence.
"""

from __future__ import annotations

from collections import deque

import torch

from ingot.engine.sequence import Sequence

DUMMY_BLOCK = 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Free-list allocator of KV blocks (ids 1..num_blocks-1)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 2, "need at least one usable block besides the dummy"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(1, num_blocks))

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


class KVCachePool:
    """Each layer's K and V blocks, [blocks, block_size, kv_heads, head_dim], in separate tensors.

    Separate allocations on purpose: views of one shared tensor would alias
    each other as inputs of a compiled graph, and AOTAutograd then clones the
    whole pool around every ``store_kv`` instead of mutating it in place.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elem

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def block_usage(self) -> torch.Tensor:
        """[num_blocks] bool: blocks holding any non-zero K or V (tests, debugging)."""
        used = torch.zeros(self.num_blocks, dtype=torch.bool, device=self.k[0].device)
        for t in (*self.k, *self.v):
            used |= t.flatten(1).ne(0).any(1)
        return used
