"""WeightSelector: which part of a checkpoint tensor a reader returns."""

from __future__ import annotations

from typing import Callable, Optional

import torch

# HF tensor name -> the index (one slice per leading dim) to read, or None for the whole tensor
WeightSelector = Callable[[str], Optional[tuple[slice, ...]]]


def select(tensor: torch.Tensor, name: str, selector: Optional[WeightSelector]) -> torch.Tensor:
    """``tensor`` cut to what ``selector`` asks for ``name`` (a copy, so the rest can be freed)."""
    index = selector(name) if selector is not None else None
    return tensor if index is None else tensor[index].clone()
