"""Quantize to FP8 and record statistics in the same function: the pure-PyTorch reference.

This is the CPU path and the specification the Triton kernels (``triton_quantize``, ``triton_current``) are
tested against.

Numerics (DESIGN.md, "FP8 facts"):

* ``q = fp8(clamp(x * scale, -FP8_MAX, FP8_MAX))``, computed in float32. The clamp makes saturation explicit:
  a plain cast's handling of out-of-range values differs between PyTorch versions and devices (on the CPU
  today E4M3 saturates while E5M2 gives ``inf``). A large finite input therefore never becomes NaN or Inf.
  ``+-Inf`` inputs saturate to ``+-FP8_MAX``; NaN stays NaN.
* dequantize: ``q * scale_inv`` with ``scale_inv = 1 / scale``.

Statistics, one float64 row ``(amax, scale, overflow, underflow, nonfinite, numel)`` per call:

* ``amax``: ``max |x|`` of the unscaled input. NaN propagates (one NaN element gives a NaN amax), Inf gives
  Inf: a non-finite amax is itself the health signal, and the delayed-scaling update keeps the previous scale
  when it sees one.
* ``scale``: the scale used.
* ``overflow``: finite elements with ``|x * scale| > FP8_MAX`` (they saturated), including finite elements
  whose float32 product overflowed to Inf.
* ``underflow``: finite non-zero elements that quantize to zero, i.e. ``|x * scale| <= min_subnormal / 2``
  (round-to-nearest-even sends exactly half the smallest subnormal to zero).
* ``nonfinite``: NaN and Inf elements of ``x``.
* ``numel``: elements quantized.

An empty ``x`` gives an empty ``q`` and the row ``(0, scale, 0, 0, 0, 0)``.

When a ``stats`` row is passed, the call accumulates into it in place (amax: max, NaN propagating;
counts and numel: sum; scale: overwritten), which is how micro-batches of one step add up.
"""

from __future__ import annotations

import torch

__all__ = [
    "KERNEL_MAX_NUMEL",
    "STAT_COLUMNS",
    "current_scale_reference",
    "dequantize",
    "fp8_max",
    "quantize_current_reference",
    "quantize_with_stats_reference",
    "tensor_amax_reference",
    "underflow_threshold",
]

#: Column order of every statistics row / table.
STAT_COLUMNS = ("amax", "scale", "overflow", "underflow", "nonfinite", "numel")

#: Largest element count the Triton kernels address (int32 offsets); larger tensors use the references.
KERNEL_MAX_NUMEL = 2**31 - 2**24


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(fp8_dtype).max)


def underflow_threshold(fp8_dtype: torch.dtype) -> float:
    """Largest magnitude that quantizes to zero: half the smallest subnormal."""
    fi = torch.finfo(fp8_dtype)
    return float(fi.smallest_normal) * float(fi.eps) / 2


def tensor_amax_reference(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a float32 0-dim tensor; NaN propagates. One pass (``aminmax``), no ``abs`` copy."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)  # the neutral element of the max
    mn, mx = torch.aminmax(x)
    return torch.maximum(-mn, mx).to(torch.float32)


_MIX: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _mix(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Constant matrix: raw counts -> (overflow, underflow, nonfinite, numel); cached per device."""
    if device not in _MIX:
        # raw counts: [|xs| > max, |xs| <= threshold, nonzero(x), isinf(x), isnan(x)]
        mix = torch.tensor(
            [
                [1, 0, 0, -1, 0],  # overflow  = big - inf inputs
                [0, 1, 1, 0, 0],  # underflow = small - zeros = small + nonzero - numel
                [0, 0, 0, 1, 1],  # nonfinite = inf + nan
                [0, 0, 0, 0, 0],  # numel (offset only)
            ],
            dtype=torch.float64,
        )
        offset = torch.tensor([0.0, -1.0, 0.0, 1.0], dtype=torch.float64)  # times numel
        _MIX[device] = (mix.to(device), offset.to(device))
    return _MIX[device]


def quantize_with_stats_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with ``scale`` to ``fp8_dtype`` and compute its statistics.

    Args:
        x: any floating tensor.
        scale: float32 0-dim tensor (on ``x``'s device).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        stats: optional float64 ``(6,)`` row to accumulate into (see the module docstring).
        amax: ``max |x|`` if the caller computed it already (current scaling), to skip a pass.
    Returns:
        ``(q, stats_row)``: the FP8 tensor (shape of ``x``) and the float64 ``(6,)`` statistics of this call
        (``stats`` itself when given, after accumulation).
    """
    fmax = fp8_max(fp8_dtype)
    xf = x if x.dtype == torch.float32 else x.to(torch.float32)
    ax = xf.abs()
    if amax is None:
        # NaN propagates; an empty tensor has amax 0, the neutral element of the max
        amax = torch.amax(ax) if ax.numel() else ax.new_zeros(())
    # Counts from cheap count_nonzero passes (a bool .sum() is several times slower on the CPU), combined
    # into (overflow, underflow, nonfinite, numel) by one small matrix-vector product below.
    n_inf = torch.count_nonzero(ax == float("inf"))
    n_nan = torch.count_nonzero(ax != ax)
    n_nonzero = torch.count_nonzero(ax)
    a = ax.mul_(scale)  # |x * scale| exactly (scale > 0, rounding is sign-symmetric); reuses the buffer
    raw = torch.stack(
        [
            torch.count_nonzero(a > fmax),  # overflows and Inf inputs; not NaN
            torch.count_nonzero(a <= underflow_threshold(fp8_dtype)),  # zeros and underflows; not NaN
            n_nonzero,
            n_inf,
            n_nan,
        ]
    ).to(torch.float64)
    del a, ax
    xs = xf * scale
    mix, offset = _mix(x.device)
    counts = torch.add(torch.mv(mix, raw), offset, alpha=xf.numel())
    q = xs.clamp_(-fmax, fmax).to(fp8_dtype)
    if stats is None:
        row = torch.cat([amax.to(torch.float64).reshape(1), scale.to(torch.float64).reshape(1), counts])
        return q, row
    torch.maximum(stats[0], amax, out=stats[0])
    stats[1].copy_(scale)
    stats[2:].add_(counts)
    return q, stats


def current_scale_reference(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Current scaling's scale: ``FP8_MAX / amax`` in float32, clamped to the float32 maximum (tiny amax),
    1 for a zero or non-finite amax. Bit for bit ``fp8_trainer.scaling.current_scale``, which this package
    does not import."""
    amax = amax.to(torch.float32)
    # a tensor divided by a tensor: ``python_float / tensor`` would multiply by a reciprocal (two roundings)
    scale = torch.clamp(torch.full_like(amax, fp8_max(fp8_dtype)) / amax, max=torch.finfo(torch.float32).max)
    return torch.where(torch.isfinite(amax) & (amax > 0), scale, torch.ones_like(amax))


def quantize_current_reference(
    x: torch.Tensor, fp8_dtype: torch.dtype, stats: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: ``max |x|``, the scale from it, then ``quantize_with_stats_reference`` with that
    scale. Returns ``(q, scale, stats_row)``, ``scale`` a float32 0-dim tensor; no host read."""
    amax = tensor_amax_reference(x)
    scale = current_scale_reference(amax, fp8_dtype)
    q, row = quantize_with_stats_reference(x, scale, fp8_dtype, stats, amax=amax)
    return q, scale, row


def accumulate_stats(stats: torch.Tensor, row: torch.Tensor) -> None:
    """Fold one call's ``row`` into an accumulating ``stats`` row in place (see the module docstring)."""
    torch.maximum(stats[0:1], row[0:1], out=stats[0:1])
    stats[1:2].copy_(row[1:2])
    stats[2:].add_(row[2:])


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` in ``dtype``."""
    return (q.to(torch.float32) * scale_inv).to(dtype)
