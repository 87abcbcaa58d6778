"""TensorParallel: a rank's place in its tensor-parallel group, and which shard it owns.

Layers receive a ``TensorParallel`` when they are built (``SINGLE`` without
tensor parallelism) and size their weights from it; nothing reads process-wide
state. Every rank of a group is one process; the group is the whole
``torch.distributed`` world (``process_group.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # c10d name of the group (``ProcessGroup.group_name``), what the functional
    # collectives take; "" without tensor parallelism
    group_name: str = ""

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


SINGLE = TensorParallel()


def shard_range(units: int, tp: TensorParallel, replicate: bool = False) -> tuple[int, int]:
    """(first unit, units) of ``units`` (heads, rows) that ``tp.rank`` owns.

    An even split when ``units`` divides by the group size. With ``replicate``,
    fewer units than ranks are shared instead: each unit is held by
    ``size // units`` consecutive ranks (KV heads under GQA). Anything else is a
    ValueError; callers check divisibility at the edge (``ConfigError``).
    """
    if units % tp.size == 0:
        n = units // tp.size
        return tp.rank * n, n
    if replicate and tp.size % units == 0:
        return tp.rank // (tp.size // units), 1
    raise ValueError(f"{units} cannot be split over {tp.size} ranks" + (" or replicated" if replicate else ""))


def padded_shard(units: int, tp: TensorParallel) -> tuple[int, int]:
    """(first unit, units per rank) when ``units`` is padded up to a multiple of the group
    size: every rank holds ``ceil(units / size)`` of them, the last ones past ``units``
    being padding (the vocabulary of the embedding and the lm_head)."""
    per = -(-units // tp.size)
    return tp.rank * per, per
