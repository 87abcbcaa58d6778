"""The paged KV cache on the device: one preallocated pool of fixed-size blocks per layer.

Block 0 (``DUMMY_BLOCK``) is never handed out by the engine's block manager:
padded rows of a captured decode batch write their K/V there and attend only
to it, so padding can never touch a real sequence.
"""

from __future__ import annotations

from typing import Optional

import torch

DUMMY_BLOCK = 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class KVCachePool:
    """Each layer's K and V blocks, [blocks, block_size, kv_heads, head_dim], in separate tensors;
    without ``separate_values`` only the K tensors (a model whose cache entry holds its values, as
    multi-head latent attention's latent does: ``ModelConfig.kv_cache_entry``).

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
        separate_values: bool = True,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers if separate_values else 0)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        separate_values: bool = True) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * (2 if separate_values else 1) * block_size * num_kv_heads * head_dim * elem

    def layer(self, i: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Layer ``i``'s (K, V) cache tensors; V is None when the entry holds the values."""
        return self.k[i], self.v[i] if self.v else None

    def block_usage(self) -> torch.Tensor:
        """[num_blocks] bool: blocks holding any non-zero K or V (tests, debugging)."""
        used = torch.zeros(self.num_blocks, dtype=torch.bool, device=self.k[0].device)
        for t in (*self.k, *self.v):
            used |= t.flatten(1).ne(0).any(1)
        return used
