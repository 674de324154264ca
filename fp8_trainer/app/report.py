"""Human-readable FP8 health: the per-layer table printed at the end of a run and a one-line summary."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fp8_protocol.stats import (
    AMAX,
    ERR_SQ,
    NONFINITE,
    NUMEL,
    OVERFLOW,
    SCALE,
    SUM_SQ,
    UNDERFLOW,
    no_finite_element,
    sqnr_db,
)

from ..convert import tensor_table

__all__ = ["fp8_summary", "health_table"]


def _amax(s: torch.Tensor) -> torch.Tensor:
    """Each row's amax, NaN where no element was finite: the amax ignores NaN, so a tensor gone all NaN
    reports 0, which a table would show as a tensor of zeros."""
    gone = torch.from_numpy(no_finite_element(s[:, NUMEL].numpy(), s[:, NONFINITE].numpy()))
    return torch.where(gone, torch.nan, s[:, AMAX])


def fp8_summary(stats: torch.Tensor) -> str:
    """One line over all tensors of a step: the largest amax (of the tensors with a finite element; NaN when
    none has one), the summed counts and, where the block has the quality columns, the lowest SQNR of a
    tensor."""
    s = stats.to("cpu", torch.float64)
    amax = _amax(s)
    top = amax[~amax.isnan()].max() if not amax.isnan().all() else torch.tensor(torch.nan)
    line = (
        f"fp8: max amax {top:.3g}, overflow {int(s[:, OVERFLOW].sum())}, "
        f"underflow {int(s[:, UNDERFLOW].sum())}, nonfinite {int(s[:, NONFINITE].sum())}"
    )
    if (
        s.shape[1] > ERR_SQ
    ):  # the quality columns: the worst tensor's SQNR (tensors that ran, exact ones aside)
        db = sqnr_db(s[:, SUM_SQ].numpy(), s[:, ERR_SQ].numpy(), s[:, NUMEL].numpy(), s[:, NONFINITE].numpy())
        db = db[np.isfinite(db)]
        if db.size:
            line += f", min SQNR {db.min():.1f} dB"
    return line


def health_table(model: nn.Module, stats: torch.Tensor) -> str:
    """Per-layer FP8 health: amax and scale per role (amax NaN for a tensor without a finite element),
    counts summed over roles, worst tensor flagged."""
    table = tensor_table(model)
    s = stats.to("cpu", torch.float64)
    amax = _amax(s)
    lines = [
        f"{'layer':<22} {'in amax':>9} {'in scale':>9} {'w amax':>9} {'w scale':>9} {'go amax':>9} "
        f"{'go scale':>9} {'overflow':>9} {'underflow':>9} {'nonfinite':>9}"
    ]
    worst, worst_key = None, (0.0, 0.0, 0.0)
    for i in range(0, len(table), 3):
        rows = s[i : i + 3]
        cells = " ".join(f"{amax[i + r]:9.3g} {rows[r, SCALE]:9.3g}" for r in range(3))
        ovf, unf, nf = (int(rows[:, c].sum()) for c in (OVERFLOW, UNDERFLOW, NONFINITE))
        lines.append(f"{table[i].layer:<22} {cells} {ovf:9d} {unf:9d} {nf:9d}")
        for r in range(3):
            numel = max(float(rows[r, NUMEL]), 1.0)
            key = (
                float(rows[r, NONFINITE]),
                float(rows[r, OVERFLOW]) / numel,
                float(rows[r, UNDERFLOW]) / numel,
            )
            if key > worst_key:
                worst, worst_key = table[i + r].name, key
    if worst is None:
        lines.append("all tensors healthy: no overflow, underflow or non-finite values")
    else:
        nf, ovf, unf = worst_key
        lines.append(f"worst: {worst} (nonfinite {int(nf)}, overflow {share(ovf)}, underflow {share(unf)})")
    return "\n".join(lines)


def share(fraction: float) -> str:
    """A fraction of elements as a percentage; one too small for two decimals reads "<0.01%", not "0.00%"
    (a few saturated elements of millions are still saturated)."""
    if 0 < fraction < 0.00005:
        return "<0.01%"
    return f"{fraction:.2%}"
