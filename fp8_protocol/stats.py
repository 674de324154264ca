"""The per-tensor statistics both sides speak of, and how a float that may be non-finite travels in JSON."""

from __future__ import annotations

import math

#: The columns of every statistics row, table and telemetry step, in this order.
STAT_COLUMNS: tuple[str, ...] = ("amax", "scale", "overflow", "underflow", "nonfinite", "numel")
#: Column positions, by name (``row[AMAX]``).
AMAX, SCALE, OVERFLOW, UNDERFLOW, NONFINITE, NUMEL = range(len(STAT_COLUMNS))

#: Largest finite value of each FP8 format (E5M2: 57344, not 57334).
FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}

#: How JSON spells the non-finite floats (JSON itself has no NaN or Infinity).
NONFINITE_SPELLING: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_float(x: float) -> float | str:
    """A float as JSON can carry it: finite unchanged, NaN / ±inf as "NaN" / "Infinity" / "-Infinity"."""
    x = float(x)
    if x != x:
        return "NaN"
    if x == math.inf:
        return "Infinity"
    if x == -math.inf:
        return "-Infinity"
    return x
