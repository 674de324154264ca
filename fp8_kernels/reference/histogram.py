"""Exponent histogram of a tensor: how many values fall in each power of two (the PyTorch reference).

Used on demand by the flight recorder and the dashboard's per-tensor view: it shows at a glance how much of
a tensor's dynamic range an FP8 format covers with a given scale.

Layout of the returned int64 vector (length ``HIST_BINS``):

* ``[0]``: zeros (``+0`` and ``-0``);
* ``[1]``: non-finite elements (NaN, +-Inf);
* ``[2 + e - EXP_MIN]`` for ``e = EXP_MIN .. EXP_MAX``: finite non-zero elements with
  ``2**e <= |x| < 2**(e+1)``, evaluated in float32 (``EXP_MIN = -149`` is the smallest float32 subnormal,
  ``EXP_MAX = 127`` the largest finite exponent). Inputs of other dtypes are converted to float32 first,
  which is exact for bf16 and fp16.
"""

from __future__ import annotations

import torch

__all__ = ["EXP_MAX", "EXP_MIN", "HIST_BINS", "exponent_histogram_reference", "histogram_to_dict"]

EXP_MIN = -149
EXP_MAX = 127
HIST_BINS = 2 + EXP_MAX - EXP_MIN + 1


def exponent_histogram_reference(x: torch.Tensor) -> torch.Tensor:
    """Counts per power of two of ``x`` (see the module docstring for the layout), int64 on ``x``'s device."""
    v = x.detach().reshape(-1).to(torch.float32)
    out = torch.zeros(HIST_BINS, dtype=torch.int64, device=v.device)
    finite = torch.isfinite(v)
    out[0] = (v == 0).sum()
    out[1] = (~finite).sum()
    a = v[finite & (v != 0)].abs()
    if a.numel():
        # frexp gives a = m * 2**exp with 0.5 <= m < 1, exactly, subnormals included
        _, exp = torch.frexp(a)
        e = exp.to(torch.int64) - 1
        out[2:] += torch.bincount(e - EXP_MIN, minlength=HIST_BINS - 2)
    return out


def histogram_to_dict(counts: torch.Tensor) -> dict:
    """JSON-friendly form ``{"zeros", "nonfinite", "exponents": {"<e>": count}}``, non-empty bins only."""
    c = counts.to("cpu").tolist()
    exps = {str(EXP_MIN + i): n for i, n in enumerate(c[2:]) if n}
    return {"zeros": c[0], "nonfinite": c[1], "exponents": exps}
