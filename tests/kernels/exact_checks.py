"""Exact comparisons for the kernel tests: no tolerance, NaN equal to NaN, the first differences named."""

from __future__ import annotations

import torch

__all__ = ["same", "same_bits", "same_row"]


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


def same_row(kernel: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """A statistics row (or block) against the reference's: every column exact except the two sums of
    squares (``sum_sq``, ``err_sq``). Those a kernel sums per block in float32, in an order the backend
    chooses (a tree on a GPU, one after the other under the interpreter), then in float64; the reference in
    float32 too (torch's cascade sum). The terms are non-negative, so a block's sum in any order is within
    (BLOCK - 1) * 2**-24 relative of the exact sum (BLOCK: 1024 on the CPU, 4096 on a GPU); one term
    dominating its block (a saturated outlier) comes close to it, the interpreter's sequential order gets
    to about 1e-6 on 1000 similar terms."""
    from fp8_protocol.stats import ERR_SQ, SUM_SQ

    block = 4096 if kernel.device.type == "cuda" else 1024
    kernel, reference = kernel.detach().cpu(), reference.detach().cpu()
    assert kernel.shape == reference.shape, (
        f"{what}: shapes {tuple(kernel.shape)} vs {tuple(reference.shape)}"
    )
    exact = [c for c in range(kernel.shape[-1]) if c not in (SUM_SQ, ERR_SQ)]
    same(kernel[..., exact], reference[..., exact], what)
    if kernel.shape[-1] > ERR_SQ:
        sums_k, sums_r = kernel[..., SUM_SQ : ERR_SQ + 1], reference[..., SUM_SQ : ERR_SQ + 1]
        bound = (block + 32) * 2.0**-24 * sums_r.abs()  # + the reference's own (cascade) rounding
        ok = ((sums_k - sums_r).abs() <= bound) | (sums_k == sums_r)
        assert bool(ok.all()), f"{what}: sums of squares {sums_k.tolist()} vs reference {sums_r.tolist()}"
