"""Inputs and error measures shared by the kernel tests (GPU and interpreter); imports no Triton."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """||out - expected|| / ||expected||; NaN (an unwritten, poisoned element) never passes."""
    out, expected = out.float(), expected.float()
    assert out.shape == expected.shape
    assert not torch.isnan(out).any(), "NaN in the output (unwritten element?)"
    return ((out - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def paged(lens, page, hkv, d, dtype, gen, extra_cols=2, device="cpu"):
    """Random caches and a shuffled block table covering ``lens`` (unused columns 0)."""
    b = len(lens)
    m = max(-(-n // page) for n in lens) + extra_cols
    nb = b * m + 2
    k_cache = torch.randn(nb, page, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, page, hkv, d, generator=gen).to(dtype)
    ids = (torch.randperm(nb - 1, generator=gen) + 1)[: b * m].view(b, m)
    table = torch.zeros(b, m, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // page)
        table[i, :used] = ids[i, :used].to(torch.int32)
    return k_cache.to(device), v_cache.to(device), table.to(device)
