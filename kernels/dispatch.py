"""The one dispatch point for quantize-and-record-statistics.

``quantize_with_stats`` and ``tensor_amax`` choose an implementation by device type. The CPU (and, until
the Triton kernels of a later issue register themselves with ``register``, every device) uses the
pure-PyTorch reference in ``fp8_kernels.quantize``. A registered implementation must follow the reference's
contract exactly (same signature, same statistics row, same bits).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .quantize import quantize_with_stats_reference, tensor_amax_reference

__all__ = ["quantize_with_stats", "register", "tensor_amax"]

_QUANTIZE: dict[str, Callable] = {}
_AMAX: dict[str, Callable] = {}


def register(device_type: str, *, quantize: Callable | None = None, amax: Callable | None = None) -> None:
    """Route ``device_type`` (e.g. ``"cuda"``) to other implementations; ``None`` restores the reference."""
    for table, fn in ((_QUANTIZE, quantize), (_AMAX, amax)):
        if fn is None:
            table.pop(device_type, None)
        else:
            table[device_type] = fn


def quantize_with_stats(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to ``fp8_dtype`` with ``scale`` and record its statistics (``fp8_kernels.quantize``)."""
    fn = _QUANTIZE.get(x.device.type, quantize_with_stats_reference)
    return fn(x, scale, fp8_dtype, stats, amax=amax)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as float32 0-dim tensor, NaN propagating."""
    return _AMAX.get(x.device.type, tensor_amax_reference)(x)
