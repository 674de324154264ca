"""The quality statistics from first principles, in float64, for the kernel tests: every finite FP8 value of
the format listed, each ``|x * scale|`` rounded to the nearest one by search (ties to the even code), the
squares and sums in float64. Shares nothing with the kernels but the definition (``fp8_protocol.stats``):
``sum_sq`` Σx² and ``err_sq`` Σ(q(x) − x)² over the finite values, q(x) the round trip of the float32 product
``x * scale`` (clamped to FP8_MAX, rounded, divided by the scale); ``subnormal`` the values landing on a
non-zero subnormal; ``min_abs`` the smallest non-zero finite |x|."""

from __future__ import annotations

import math

import numpy as np
import torch

FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MIN_NORMAL = {torch.float8_e4m3fn: 2.0**-6, torch.float8_e5m2: 2.0**-14}


def fp8_grid(fp8: torch.dtype) -> np.ndarray:
    """Every finite non-negative value of the format, ascending; index = code (codes 0..max are ordered)."""
    codes = torch.arange(128, dtype=torch.uint8).view(fp8).to(torch.float64).numpy()
    return codes[np.isfinite(codes) & (codes <= FMAX[fp8])]


def round_to_grid(a: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Each ``a`` (non-negative float64, at most the grid's max) to the nearest grid value, ties to the even
    code (the one whose last mantissa bit is 0)."""
    hi = np.clip(np.searchsorted(grid, a, side="left"), 0, len(grid) - 1)
    lo = np.clip(hi - 1, 0, len(grid) - 1)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(pick_hi, grid[hi], grid[lo])


def quality_first_principles(x: torch.Tensor, scale: float, fp8: torch.dtype) -> dict[str, float]:
    """``{"sum_sq", "err_sq", "subnormal", "min_abs"}`` of ``x`` quantized with ``scale``."""
    xf = x.detach().to(torch.float32).flatten()
    fin = torch.isfinite(xf).numpy()
    x64 = xf.to(torch.float64).numpy()[fin]
    a = np.abs(
        (xf[torch.from_numpy(fin)] * torch.tensor(scale, dtype=torch.float32)).to(torch.float64).numpy()
    )
    q = round_to_grid(np.minimum(a, FMAX[fp8]), fp8_grid(fp8))
    nonzero = np.abs(x64[x64 != 0])
    return {
        "sum_sq": float(np.sum(a * a)) / float(scale) ** 2,
        "sum_sq_exact": float(np.sum(x64 * x64)),
        "err_sq": float(np.sum((q - a) ** 2)) / float(scale) ** 2,
        "subnormal": float(np.count_nonzero((q > 0) & (q < MIN_NORMAL[fp8]))),
        "min_abs": float(nonzero.min()) if nonzero.size else math.inf,
    }
