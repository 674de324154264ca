"""Quantize to FP8 and record statistics in the same function: the pure-PyTorch reference.

This is the specification the Triton kernels (``triton.quantize``, ``triton.current``) and the fused CPU
kernel (``cpu.fused``) are tested against, and the CPU path where that kernel does not build.

Numerics (docs/fp8-semantics.md):

* ``q = fp8(clamp(x * scale, -FP8_MAX, FP8_MAX))``, computed in float32. The clamp makes saturation explicit:
  a plain cast's handling of out-of-range values differs between PyTorch versions and devices (on the CPU
  today E4M3 saturates while E5M2 gives ``inf``). A large finite input therefore never becomes NaN or Inf.
  ``+-Inf`` inputs saturate to ``+-FP8_MAX``; NaN stays NaN.
* dequantize: ``q * scale_inv`` with ``scale_inv = 1 / scale``.

Statistics, one float64 row per call, columns ``STAT_COLUMNS`` = ``(amax, scale, overflow, underflow,
nonfinite, numel, sum_sq, err_sq, subnormal, min_abs)``:

* ``amax``: ``max |x|`` of the unscaled input, ignoring NaN elements as Transformer Engine does (its amax is
  an ``fmaxf`` reduction, and ``fmaxf(a, NaN) = a``): an Inf element gives Inf, an all-NaN tensor gives 0.
  The NaN elements are still counted in ``nonfinite``, which is where a NaN shows up.
* ``scale``: the scale used.
* ``overflow``: finite elements whose cast really saturated: ``|x * scale|`` beyond the FP8 rounding threshold
  (``overflow_threshold``: above 464 for E4M3, at or above 61440 for E5M2), including finite elements whose
  float32 product overflowed to Inf. Values between FP8_MAX and the threshold round to FP8_MAX anyway.
* ``underflow``: finite non-zero elements that quantize to zero, i.e. ``|x * scale| <= min_subnormal / 2``
  (round-to-nearest-even sends exactly half the smallest subnormal to zero).
* ``nonfinite``: NaN and Inf elements of ``x``.
* ``numel``: elements quantized.
* ``sum_sq`` and ``err_sq``: ``Σx²`` and ``Σ(q(x) - x)²`` over the finite elements, in ``x``'s units, taken
  in the scaled domain: ``a = |x * scale|`` (the float32 product; the exact float64 product where that
  overflowed) and the FP8 value of the clamped ``a``, their squares and sums in float64, divided by
  ``scale**2``. NaN and Inf elements are left out (they are counted in ``nonfinite``); saturation and
  underflow are errors like any rounding. Both stay finite for every finite ``x`` and scale, however far a
  stale scale overflows. SQNR in dB is ``fp8_protocol.stats.sqnr_db(sum_sq, err_sq)``.
* ``subnormal``: elements landing on a non-zero FP8 subnormal (at most 3 significant bits in E4M3, 2 in
  E5M2): ``min_subnormal / 2 < |x * scale| < subnormal_threshold``.
* ``min_abs``: the smallest non-zero finite ``|x|`` (+inf when there is none); with ``amax``, the dynamic
  range the tensor spans.

A ``(6,)`` row (the base columns alone, ``new_stats(quality=False)``) makes the call skip the quality
columns. An empty ``x`` gives an empty ``q`` and the row ``(0, scale, 0, 0, 0, 0, 0, 0, 0, inf)``.

When a ``stats`` row is passed, the call accumulates into it in place, which is how micro-batches of one
step add up: amax the max ignoring NaN (``fmax``); scale the one of the call whose amax is now the row's
(on a tie the later call's), so that an amax is always reported beside the scale that scaled it (with
current scaling each micro-batch has its own); counts, numel and the sums of squares the sum; ``min_abs``
the min (``fp8_protocol.stats.MERGE``). A fresh row to accumulate into starts with ``min_abs`` +inf
(``new_stats``).
"""

from __future__ import annotations

import math
import threading

import torch

from fp8_protocol.stats import (
    AMAX,
    BASE_COLUMNS,
    MIN_ABS,
    OVERFLOW,
    SCALE,
    SUM_SQ,
)
from fp8_protocol.stats import STAT_COLUMNS as _PROTOCOL_COLUMNS

__all__ = [
    "KERNEL_MAX_NUMEL",
    "STAT_COLUMNS",
    "check_dbias_operand",
    "column_sums_reference",
    "current_scale_reference",
    "dequantize",
    "fp8_bits_to_float",
    "fp8_max",
    "min_nonzero_reference",
    "new_stats",
    "overflow_threshold",
    "quantize_current_reference",
    "quantize_with_stats_reference",
    "quality_row_reference",
    "subnormal_threshold",
    "tensor_amax_reference",
    "underflow_threshold",
]

#: Column order of every statistics row / table (defined once, in the protocol both sides share).
STAT_COLUMNS = _PROTOCOL_COLUMNS

#: Largest element count the Triton kernels address (int32 offsets); larger tensors use the references.
KERNEL_MAX_NUMEL = 2**31 - 2**24

#: ``0xFF800000`` as an int32: keeps a float32's sign and exponent, i.e. rounds it down to a power of two.
POW2_MASK = -(2**23)


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(fp8_dtype).max)


def underflow_threshold(fp8_dtype: torch.dtype) -> float:
    """Largest magnitude that quantizes to zero: half the smallest subnormal."""
    fi = torch.finfo(fp8_dtype)
    return float(fi.smallest_normal) * float(fi.eps) / 2


def overflow_threshold(fp8_dtype: torch.dtype) -> tuple[float, bool]:
    """``(threshold, inclusive)``: a float32 ``|x * scale|`` saturates in the cast to ``fp8_dtype`` when it is
    above ``threshold`` (at or above it if ``inclusive``).

    The threshold is FP8_MAX plus half an ulp at FP8_MAX, the midpoint to the next value up. Round to nearest
    even decides the midpoint itself: it stays at FP8_MAX when FP8_MAX's last mantissa bit is even (E4M3:
    448 = 14 ulps of 32, so up to and including 464 rounds to 448), and goes up, out of range, when it is
    odd (E5M2: 57344 = 7 ulps of 8192, so 61440 ties to 65536 = Inf).
    """
    fi = torch.finfo(fp8_dtype)
    fmax = float(fi.max)
    ulp = 2.0 ** math.floor(math.log2(fmax)) * float(fi.eps)
    return fmax + ulp / 2, int(fmax / ulp) % 2 == 1


def round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    """A positive float32 ``scale`` rounded down to a power of two: its bits masked with ``0xFF800000``."""
    return torch.bitwise_and(scale.view(torch.int32), POW2_MASK).view(torch.float32)


def tensor_amax_reference(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a float32 0-dim tensor, NaN elements ignored (all NaN: 0), Inf giving Inf."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)  # the neutral element of the max
    # aminmax propagates NaN: drop NaN first (posinf/neginf given, or nan_to_num would clamp Inf too)
    finite_or_inf = torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)
    mn, mx = torch.aminmax(finite_or_inf)
    return torch.maximum(-mn, mx).to(torch.float32)


_MIX: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _mix(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Constant matrix: raw counts -> (overflow, underflow, nonfinite, numel); cached per device."""
    if device not in _MIX:
        # raw counts: [saturated or Inf, small (zeros, underflows, NaN as 0), nonzero(x), isinf(x), isnan(x)]
        mix = torch.tensor(
            [
                [1, 0, 0, -1, 0],  # overflow  = big - inf inputs
                [0, 1, 1, 0, -1],  # underflow = small - zeros - nan = small + nonzero - numel - nan
                [0, 0, 0, 1, 1],  # nonfinite = inf + nan
                [0, 0, 0, 0, 0],  # numel (offset only)
            ],
            dtype=torch.float64,
        )
        offset = torch.tensor([0.0, -1.0, 0.0, 1.0], dtype=torch.float64)  # times numel
        _MIX[device] = (mix.to(device), offset.to(device))
    return _MIX[device]


def subnormal_threshold(fp8_dtype: torch.dtype) -> float:
    """``|x * scale|`` below this lands on an FP8 subnormal (or zero): the midpoint between the largest
    subnormal and the smallest normal, which round to nearest even sends up (the smallest normal's mantissa
    is even, the largest subnormal's odd)."""
    fi = torch.finfo(fp8_dtype)
    return float(fi.smallest_normal) * (1.0 - float(fi.eps) / 2)


def new_stats(n: int | None = None, *, device=None, quality: bool = True) -> torch.Tensor:
    """A fresh statistics row ``(C,)`` (``n`` None) or block ``(n, C)``, float64, ready to accumulate into:
    zeros, with ``min_abs`` +inf (the neutral element of its min). ``C`` is ``len(STAT_COLUMNS)``, or the
    ``BASE_COLUMNS`` alone with ``quality=False`` (the quantize functions then skip the quality columns)."""
    cols = len(STAT_COLUMNS) if quality else len(BASE_COLUMNS)
    out = torch.zeros((cols,) if n is None else (n, cols), dtype=torch.float64, device=device)
    if quality:
        out[..., MIN_ABS].fill_(math.inf)
    return out


def _row_width(stats: torch.Tensor | None) -> int:
    if stats is None:
        return len(STAT_COLUMNS)
    if stats.dim() != 1 or stats.shape[0] not in (len(BASE_COLUMNS), len(STAT_COLUMNS)):
        raise ValueError(
            f"stats: expected a ({len(STAT_COLUMNS)},) or ({len(BASE_COLUMNS)},) row, "
            f"got {tuple(stats.shape)}"
        )
    return stats.shape[0]


def fp8_bits_to_float(u: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The float32 values of non-negative finite FP8 codes ``u`` (uint8, sign bit clear): the code moved
    into a float32's exponent and mantissa fields, then scaled by 2**(127 - bias), which also gives the
    subnormals (they become float32 subnormals first, exactly). On the CPU several times faster than
    ``q.to(torch.float32)`` for E4M3 (whose cast back is not vectorised there)."""
    fi = torch.finfo(fp8_dtype)
    mant = round(-math.log2(float(fi.eps)))
    bias = 1 - round(math.log2(float(fi.smallest_normal)))
    return u.to(torch.int32).bitwise_left_shift_(23 - mant).view(torch.float32).mul_(2.0 ** (127 - bias))


def min_nonzero_reference(ax: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The smallest non-zero finite value of a non-negative float32 tensor with no NaN (+inf when there is
    none; +inf elements are not finite) as a float32 0-dim tensor: a min over the bits minus 1, with 0
    wrapped to the top (0x7FFFFFFF) and +inf landing on 0x7F7FFFFF, above every finite value's. ``out``: an
    int32 buffer of ``ax``'s shape to work in (a fresh multi-MB allocation costs more than the pass)."""
    if ax.numel() == 0:
        return ax.new_full((), math.inf)
    m = torch.sub(ax.view(torch.int32), 1, out=out).bitwise_and_(0x7FFFFFFF).amin()
    return torch.where(m >= 0x7F7FFFFF, 0x7F800000, m + 1).to(torch.int32).view(torch.float32)


_WORK = threading.local()


def _work_buffer(shape: torch.Size, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A scratch tensor of ``shape`` and ``dtype``. On the CPU a view of one buffer per thread and dtype,
    grown to the largest tensor seen and reused: a fresh multi-MB allocation there costs its page faults at
    every call, more than the passes over it (a GPU's caching allocator has no such cost)."""
    numel = math.prod(shape)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    bufs = _WORK.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def quality_row_reference(
    a: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    min_abs: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    mask_codes: bool,
    x: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(sum_sq, err_sq, subnormal, min_abs)`` (float64) from ``a = |x * scale|`` (float32; 0 for the NaN
    and Inf elements of ``x``, +inf for a finite ``x`` whose product overflowed) and the FP8 tensor ``q``.
    ``mask_codes``: ``q`` was cast from ``x`` itself, whose NaN/Inf elements have non-zero codes: their
    errors are zeroed where ``a`` is 0 (where every other element's error is 0 anyway); their codes are no
    subnormal's. The round trip is taken in the scaled domain, ``err = (|q| - a) / scale`` with ``|q|``
    decoded from its bits, and every square and sum in float64: a float32 square overflows past
    ``a`` = 1.8e19, which a stale delayed scale meeting a spike reaches, and would make both sums +inf (SQNR
    "no finite element" for a finite tensor). Where the float32 product itself overflowed, ``a`` is the exact
    product ``|x| * scale`` in float64 (``x``, the input, is then needed). Then both sums over ``scale**2``.
    ``work``: an int32 buffer of ``q``'s shape to use (the CPU pays more for a fresh multi-MB allocation
    than for a pass over it)."""
    # |q|: its code without the sign
    code = torch.bitwise_and(q.view(torch.uint8), 0x7F, out=_work_buffer(q.shape, q.device, torch.uint8))
    fi = torch.finfo(fp8_dtype)
    mant = round(-math.log2(float(fi.eps)))
    bias = 1 - round(math.log2(float(fi.smallest_normal)))
    work = torch.empty(code.shape, dtype=torch.int32, device=code.device) if work is None else work
    # |q| decoded in place (fp8_bits_to_float)
    qa = work.copy_(code).bitwise_left_shift_(23 - mant).view(torch.float32).mul_(2.0 ** (127 - bias))
    scale64 = scale.to(torch.float64)
    a64 = a.to(torch.float64)
    overflowed = torch.isinf(a)  # only finite x: the NaN / Inf elements are 0 in a
    if bool(overflowed.any()):  # a host read: the reference only
        a64[overflowed] = x[overflowed].to(torch.float64).abs() * scale64
    d = qa.to(torch.float64).sub_(a64)
    if mask_codes:  # d * sign(a): 0 where a is 0 (a NaN/Inf x, whose code is not; or d was 0 already)
        d.mul_(torch.sign(a))
    err_sq = d.square_().sum()
    sum_sq = a64.square_().sum()
    # subnormal codes are 1 .. 2**mant - 1 (exponent field 0): code - 1 wraps 0 to 255
    subnormal = torch.count_nonzero(code.sub_(1).lt_(2**mant - 1))
    inv2 = scale64.reciprocal().square()
    sums = torch.stack([sum_sq, err_sq]) * inv2
    return torch.cat([sums, subnormal.to(torch.float64).reshape(1), min_abs.to(torch.float64).reshape(1)])


def check_dbias_operand(x: torch.Tensor) -> None:
    """The bias gradient (``dbias=True``) is the column sums of a 2-D ``x``: refuse any other shape."""
    if x.dim() != 2:
        raise ValueError(f"x: dbias needs a 2-D (tokens, features) tensor, got shape {tuple(x.shape)}")


def column_sums_reference(x: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a 2-D ``grad_output``: ``x.sum(0)`` accumulated in float32, in ``x``'s dtype
    (NaN and Inf propagate as in any sum)."""
    check_dbias_operand(x)
    return x.detach().sum(0, dtype=torch.float32).to(x.dtype)


def quantize_with_stats_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Quantize ``x`` with ``scale`` to ``fp8_dtype`` and compute its statistics.

    Args:
        x: any floating tensor.
        scale: float32 0-dim tensor (on ``x``'s device).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        stats: optional float64 row to accumulate into (see the module docstring): ``(10,)``, or ``(6,)``
            for the base columns alone (the quality statistics are then not computed).
        amax: ``max |x|`` if the caller computed it already (current scaling), to skip a pass; recorded as
            ``|amax|`` with NaN read as 0, as the kernels do.
        dbias: also return the column sums of a 2-D ``x`` (the bias gradient when ``x`` is
            ``grad_output``): ``column_sums_reference``.
    Returns:
        ``(q, stats_row)``: the FP8 tensor (shape of ``x``) and the float64 statistics of this call, ``(10,)``
        (``stats`` itself when given, after accumulation); ``(q, stats_row, dbias)`` with ``dbias``.
    """
    if dbias:
        check_dbias_operand(x)
        q, row = quantize_with_stats_reference(x, scale, fp8_dtype, stats, amax=amax)
        return q, row, column_sums_reference(x)
    quality = _row_width(stats) == len(STAT_COLUMNS)
    x, scale = x.detach(), scale.detach()  # statistics and FP8 bits: nothing to differentiate
    xf = x if x.dtype == torch.float32 else x.to(torch.float32)
    ax = xf.abs()
    # Counts from cheap count_nonzero passes (a bool .sum() is several times slower on the CPU), combined
    # into (overflow, underflow, nonfinite, numel) by one small matrix-vector product (_counts).
    n_inf = torch.count_nonzero(ax == math.inf)
    n_nan = torch.count_nonzero(ax != ax)
    n_nonzero = torch.count_nonzero(ax)
    # NaN ignored by the amax (counted above); with the quality statistics Inf reads as 0 too (they are
    # over the finite values), and the amax and the counts below take the Inf elements from n_inf instead
    ax.nan_to_num_(nan=0.0, posinf=0.0 if quality else math.inf)
    amax = _call_amax(ax, amax, n_inf, quality)
    if quality:  # one int32 buffer for the quality passes; the min before scaling: |x| itself
        work = _work_buffer(ax.shape, ax.device)
        min_abs = min_nonzero_reference(ax, out=work)
    a = ax.mul_(scale)  # |x * scale| exactly (scale > 0, rounding is sign-symmetric); reuses the buffer
    counts = _counts(a, fp8_dtype, n_inf, n_nan, n_nonzero, quality)
    fmax = fp8_max(fp8_dtype)
    q = (xf * scale).clamp_(-fmax, fmax).to(fp8_dtype)
    quality_row = None
    if quality:
        quality_row = quality_row_reference(a, q, scale, min_abs, fp8_dtype, mask_codes=True, x=xf, work=work)
    del a, ax
    if stats is None:
        row = torch.cat(
            [amax.to(torch.float64).reshape(1), scale.to(torch.float64).reshape(1), counts, quality_row]
        )
        return q, row
    return q, _accumulate(stats, amax, scale, counts, quality_row)


def _call_amax(
    ax: torch.Tensor, amax: torch.Tensor | None, n_inf: torch.Tensor, quality: bool
) -> torch.Tensor:
    """The call's amax: the max of ``ax`` (``|x|`` with NaN as 0, and Inf as 0 too with ``quality``, when
    ``n_inf`` puts it back), or the caller's ``amax`` as ``|amax|`` with NaN read as 0."""
    if amax is not None:
        return torch.nan_to_num(amax.detach().abs().to(torch.float32), nan=0.0, posinf=math.inf)
    found = torch.amax(ax) if ax.numel() else ax.new_zeros(())  # empty: 0, the neutral element
    return torch.where(n_inf > 0, math.inf, found) if quality else found


def _counts(
    a: torch.Tensor,
    fp8_dtype: torch.dtype,
    n_inf: torch.Tensor,
    n_nan: torch.Tensor,
    n_nonzero: torch.Tensor,
    quality: bool,
) -> torch.Tensor:
    """``(overflow, underflow, nonfinite, numel)`` (float64) from ``a = |x * scale|`` (NaN as 0; with
    ``quality`` Inf as 0 too) and the counts of ``x``'s Inf, NaN and non-zero elements."""
    threshold, inclusive = overflow_threshold(fp8_dtype)
    big = a >= threshold if inclusive else a > threshold
    n_big = torch.count_nonzero(big)  # saturated, and Inf inputs (counted in n_inf where they read as 0)
    del big
    n_small = torch.count_nonzero(a <= underflow_threshold(fp8_dtype))  # zeros, underflows, NaN (now 0)
    if quality:  # the Inf elements are 0 here, among the small ones: as if they were still Inf
        n_big, n_small = n_big + n_inf, n_small - n_inf
    raw = torch.stack([n_big, n_small, n_nonzero, n_inf, n_nan]).to(torch.float64)
    mix, offset = _mix(a.device)
    return torch.add(torch.mv(mix, raw), offset, alpha=a.numel())


def _accumulate(
    stats: torch.Tensor,
    amax: torch.Tensor,
    scale: torch.Tensor,
    counts: torch.Tensor,
    quality_row: torch.Tensor | None,
) -> torch.Tensor:
    """Add one call's statistics into the row ``stats`` in place (module docstring) and return it."""
    amax64 = amax.to(torch.float64)
    # the scale of the call that set the amax (a NaN in the row counts as nothing, as fmax reads it)
    takes = (amax64 >= stats[AMAX]) | torch.isnan(stats[AMAX])
    stats[SCALE].copy_(torch.where(takes, scale.to(torch.float64), stats[SCALE]))
    torch.fmax(stats[AMAX], amax64, out=stats[AMAX])
    stats[OVERFLOW:SUM_SQ].add_(counts)
    if quality_row is not None:
        stats[SUM_SQ:MIN_ABS].add_(quality_row[:3])
        torch.fmin(stats[MIN_ABS], quality_row[3], out=stats[MIN_ABS])
    return stats


def current_scale_reference(
    amax: torch.Tensor, fp8_dtype: torch.dtype, *, power_2_scale: bool = False
) -> torch.Tensor:
    """Current scaling's scale: ``FP8_MAX / amax`` in float32, clamped to the float32 maximum (tiny amax),
    1 for a zero or non-finite amax; with ``power_2_scale``, rounded down to a power of two (Transformer
    Engine's ``force_pow_2_scales``). Bit for bit ``fp8_trainer.scaling.current_scale``, which this package
    does not import."""
    amax = amax.to(torch.float32)
    # a tensor divided by a tensor: ``python_float / tensor`` would multiply by a reciprocal (two roundings)
    scale = torch.clamp(torch.full_like(amax, fp8_max(fp8_dtype)) / amax, max=torch.finfo(torch.float32).max)
    scale = torch.where(torch.isfinite(amax) & (amax > 0), scale, torch.ones_like(amax))
    return round_down_pow2(scale) if power_2_scale else scale


def quantize_current_reference(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    power_2_scale: bool = False,
    return_scale_inv: bool = False,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Current scaling: ``max |x|`` (NaN ignored), the scale from it (``current_scale_reference``), then
    ``quantize_with_stats_reference`` with that scale. Returns ``(q, scale, stats_row)``, ``scale`` a float32
    0-dim tensor; no host read. ``return_scale_inv``: ``(q, scale, scale_inv, stats_row)`` with
    ``scale_inv = torch.reciprocal(scale)`` (what every ``current`` kernel returns there, bit for bit).
    ``dbias``: the column sums of a 2-D ``x`` appended (``column_sums_reference``)."""
    if dbias:
        check_dbias_operand(x)
    amax = tensor_amax_reference(x.detach())
    scale = current_scale_reference(amax, fp8_dtype, power_2_scale=power_2_scale)
    q, row = quantize_with_stats_reference(x, scale, fp8_dtype, stats, amax=amax)
    out = (q, scale, torch.reciprocal(scale), row) if return_scale_inv else (q, scale, row)
    return (*out, column_sums_reference(x)) if dbias else out


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` in ``dtype``."""
    return (q.to(torch.float32) * scale_inv).to(dtype)
