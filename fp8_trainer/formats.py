"""FP8 format facts: the numbers every quantization and scale update depends on.

| | E4M3 (``torch.float8_e4m3fn``) | E5M2 (``torch.float8_e5m2``) |
|---|---|---|
| max finite | 448 | 57344 |
| min normal | 2^-6 | 2^-14 |
| min subnormal | 2^-9 | 2^-16 |
| inf | none (NaN only) | yes |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8_protocol.tensors import ROLES

__all__ = [
    "E4M3",
    "E5M2",
    "FP8Format",
    "FLOAT32_MAX",
    "ROLES",
]


@dataclass(frozen=True)
class FP8Format:
    """One FP8 encoding: its name, torch dtype and range."""

    name: str
    dtype: torch.dtype
    max: float
    min_normal: float
    min_subnormal: float
    has_inf: bool

    @property
    def underflow_threshold(self) -> float:
        """Largest magnitude that rounds to zero: half the smallest subnormal (the tie rounds to even, 0)."""
        return self.min_subnormal / 2


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9, has_inf=False)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16, has_inf=True)

#: Largest finite float32: a scale that would be larger (tiny amax) is clamped to it.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

#: The three quantized tensors of one FP8 Linear, in index order (layer k owns 3k, 3k+1, 3k+2).
