"""The memory floor of a decode step: the bytes it must read, at the measured copy bandwidth.

A decode step reads every weight it uses plus the batch's KV cache at least once;
``ingot bench decode`` reports how close each mode gets to that time. Pure
functions (they run on CPU); ``ModelBytes.of`` counts a built model's parameters
as stored, so a quantized model's floor is its own byte count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence


def expected_experts_hit(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts one sparse layer reads for ``batch`` tokens routed uniformly at random.

    Each token picks ``top_k`` distinct experts of ``num_experts``, so it misses a given
    expert with probability 1 - k/E, and all ``batch`` tokens miss it with (1 - k/E)^batch.
    Qwen3-30B-A3B (128 experts, top-8): 8 at batch 1, 82.4 at batch 16, 128.0 at 256.
    """
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class ModelBytes:
    """What one decode step must read at least: the weights it uses, plus the batch's KV cache.

    A dense step uses every weight. A mixture-of-experts step reads its dense part
    (``weight_bytes``: attention, norms, routers, shared experts, dense layers, the
    embedding table and the head) plus, in each sparse layer, the routed experts its
    tokens hit. The experts hit are the expected number of distinct experts under
    uniform random routing (``expected_experts_hit``), not counted from the benchmark's
    own routing, unless ``hits`` are given: the distinct experts each sparse layer's
    routing sent the timed step's tokens to (``bench_decode`` counts them; a trained router
    concentrates tokens and hits fewer than uniform routing would). The embedding table
    counts whole, as in the dense floor and in published active-parameter counts
    (Qwen3-30B-A3B: 3.35B at batch 1), though a step gathers only its batch's rows.
    """

    weight_bytes: int  # every weight but the routed experts
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_elem_size: int  # bytes per cached K or V element
    expert_bytes: int = 0  # one routed expert of one layer: its gate, up and down projections
    moe_layers: int = 0  # layers with routed experts
    num_experts: int = 0
    top_k: int = 0
    kv_parts: int = 2  # cached tensors per layer: K and V, or one (latent attention's entry)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (0: the whole context); () = none

    def kv_bytes(self, batch: int, context_len: int) -> int:
        """K and V (or the one cache entry) of the cached tokens each layer reads, per sequence:
        ``context_len`` for a global layer, at most its window for a sliding one (Gemma 2/3's
        local layers, gpt-oss's: window-aware, so a 32k context costs the window there)."""
        windows = self.layer_windows or (0,) * self.num_layers
        tokens = sum(min(context_len, w) if w else context_len for w in windows)
        return batch * tokens * self.kv_parts * self.num_kv_heads * self.head_dim * self.kv_elem_size

    def experts_hit(self, batch: int, hits: Optional[Sequence[int]] = None) -> float:
        """Distinct routed experts per sparse layer at ``batch`` tokens: the mean of the counted
        ``hits`` (one per sparse layer), else the expectation under uniform routing (0 for dense models)."""
        if not self.moe_layers:
            return 0.0
        if hits is not None:
            return sum(hits) / len(hits)
        return expected_experts_hit(self.num_experts, self.top_k, batch)

    def weight_bytes_read(self, batch: int, hits: Optional[Sequence[int]] = None) -> float:
        return self.weight_bytes + self.moe_layers * self.experts_hit(batch, hits) * self.expert_bytes

    def step_bytes(self, batch: int, context_len: int, hits: Optional[Sequence[int]] = None) -> float:
        return self.weight_bytes_read(batch, hits) + self.kv_bytes(batch, context_len)

    @classmethod
    def of(cls, model: Any, cfg: Any, dtype: Any) -> "ModelBytes":
        """From a built model (unique parameters; tied weights count once) and its ModelConfig."""
        import torch

        from ingot.layers.fused_moe import FusedMoE

        total = sum(p.numel() * p.element_size() for p in model.parameters())
        elem = torch.empty((), dtype=dtype).element_size()
        sparse = [m for m in model.modules() if isinstance(m, FusedMoE)]
        entry = cfg.kv_cache_entry
        kv = dict(num_layers=cfg.num_layers, num_kv_heads=entry.heads, head_dim=entry.head_dim, kv_elem_size=elem,
                  kv_parts=2 if entry.separate_values else 1, layer_windows=tuple(cfg.layer_windows))
        if not sparse:
            return cls(int(total), **kv)
        routed = sum(p.numel() * p.element_size() for m in sparse for p in m.parameters())
        per_expert = routed // (len(sparse) * sparse[0].num_experts)
        return cls(int(total - routed), **kv, expert_bytes=int(per_expert), moe_layers=len(sparse),
                   num_experts=sparse[0].num_experts, top_k=cfg.num_experts_per_tok)


def copy_bandwidth(nbytes: int, ms: float) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes``: it reads them and writes them."""
    return 2 * nbytes / (ms / 1e3)


def floor_ms(
    model_bytes: ModelBytes, batch: int, context_len: int, bandwidth: float, hits: Optional[Sequence[int]] = None
) -> float:
    """Milliseconds to move one step's minimum bytes at ``bandwidth`` bytes/s (``hits``: see ``ModelBytes``)."""
    return model_bytes.step_bytes(batch, context_len, hits) / bandwidth * 1e3


def floor_fraction(floor: float, step_ms: float) -> float:
    """Fraction of the memory floor reached: 1.0 = the step runs at copy bandwidth."""
    return floor / step_ms


def tokens_per_s(batch: int, step_ms: float) -> float:
    return batch / (step_ms / 1e3)
