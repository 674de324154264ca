"""Exact comparisons for the kernel tests: no tolerance, NaN equal to NaN, the first differences named."""

from __future__ import annotations

import torch

__all__ = ["same", "same_bits"]


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Exact equality, NaN equal to NaN, with the first differing positions in the message."""
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, (
        f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    if not bool(same.all()):
        idx = (~same).flatten().nonzero().flatten()[:5].tolist()
        fa, fb = a.flatten(), b.flatten()
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {a.numel()} differ; first at flat {idx}: "
            f"kernel {[fa[i].item() for i in idx]} vs reference {[fb[i].item() for i in idx]}"
        )


def same_bits(q: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    same(q.view(torch.uint8), ref.view(torch.uint8), what)
