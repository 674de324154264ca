"""The per-tensor statistics both sides speak of: their columns, how they merge, the FP8 limits they are
measured against and the quantities the dashboard and the detectors derive from them. (How a float that may
be non-finite travels in JSON: `fp8_protocol.codec`.)"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

#: The columns every statistics row has and every telemetry step with statistics must carry, in this order.
BASE_COLUMNS: tuple[str, ...] = ("amax", "scale", "overflow", "underflow", "nonfinite", "numel")
#: Quantization-quality columns, computed in the same pass that quantizes (all four or none in a step):
#: ``sum_sq`` Σx² and ``err_sq`` Σ(q(x)−x)² over the finite values, in the tensor's own units (q(x) is the
#: value after the FP8 round trip: scaled, cast with saturation, unscaled); ``subnormal`` how many values land
#: on a non-zero FP8 subnormal (|x·scale| below the format's smallest normal, not flushed to zero);
#: ``min_abs`` the smallest non-zero finite |x| (+inf when there is none). A sender that does not compute
#: them (an older client, a caller's own statistics) leaves them out; the service accepts either.
QUALITY_COLUMNS: tuple[str, ...] = ("sum_sq", "err_sq", "subnormal", "min_abs")
#: The columns of a statistics row, table and telemetry step, in this order.
STAT_COLUMNS: tuple[str, ...] = BASE_COLUMNS + QUALITY_COLUMNS
#: Block-scaling columns (MXFP8 1x32 and FP8 block 1x128 / 128x128 recipes; a single per-tensor scale says
#: little there). They describe the tensor's row-wise copy (blocks along its last dimension, the copy the
#: forward GEMM reads); a per-tensor-scaled tensor has no blocks and reports zeros in all six. A sender
#: includes them (all six, in every step of a batch) once any tensor of the run has been block-scaled:
#: ``blocks`` how many scale blocks were quantized; ``blocks_at_limit`` how many blocks with something to
#: scale had their scale pinned at a limit of its format (E8M0 code 0 or 254; a float32 block scale that
#: fell back to 1 for a non-finite amax, or was clamped because FP8_MAX / amax overflowed): values the
#: format could not follow, a loss; ``blocks_overflow`` / ``blocks_underflow`` how many blocks saturated /
#: flushed to zero at least one finite value; ``block_range`` the worst block's dynamic range,
#: log2(max |x| / smallest non-zero |x|) in binades over its finite values (0 for none); ``blocks_zero`` how
#: many blocks had amax 0 (every element zero, or NaN, which the amax ignores: padding, ReLU zeros), whose
#: scale sits at the format's floor (E8M0 code 0) or falls back to 1 with nothing to lose: counted here and
#: never in ``blocks_at_limit``, so a sparse tensor does not read as a fault. (``blocks_zero`` came last; the
#: service still takes the first five alone from an older sender, whose ``blocks_at_limit`` then includes
#: the zero blocks.) For such a tensor the base columns keep their meaning per element (overflow,
#: underflow, nonfinite, numel, the quality columns), ``amax`` is the tensor's, and ``scale`` is the
#: smallest block scale (that of the block holding the amax), so ``FP8_MAX / (amax * scale)`` is the worst
#: block's headroom.
BLOCK_COLUMNS: tuple[str, ...] = (
    "blocks",
    "blocks_at_limit",
    "blocks_overflow",
    "blocks_underflow",
    "block_range",
    "blocks_zero",
)
#: The block columns an older sender sends (the service takes them without ``blocks_zero``).
LEGACY_BLOCK_COLUMNS: tuple[str, ...] = BLOCK_COLUMNS[:5]
#: The block scale exponent histogram a block-scaled tensor sends with each step (the step's
#: ``"block_hist"``: a list of ``[tensor index, lo, counts]``): ``counts[j]`` blocks whose ``scale_inv`` has
#: the biased binary exponent ``lo + j`` (the E8M0 code itself; for a float32 scale its exponent field, 127
#: meaning [1, 2)); only the non-zero span is sent, so ``0 <= lo`` and
#: ``lo + len(counts) <= BLOCK_HIST_BINS``. Every block is counted once, so the counts add up to the step's
#: ``blocks``; a block whose amax is NaN has the E8M0 NaN code 255 and lands in the last bin (it is not
#: counted in ``blocks_at_limit``; the all-zero blocks are in ``blocks_zero``, not there). Over micro-steps
#: and over the ranks of a data-parallel job the counts add up per bin, as the block columns merge
#: (``MERGE``): a multi-rank sender reports the merge of every rank's block part, so a block that overflowed
#: on any rank shows.
BLOCK_HIST_BINS = 256
#: The columns that count something (elements, blocks): whole numbers, exported as integers.
COUNT_COLUMNS: frozenset[str] = frozenset(
    {"overflow", "underflow", "nonfinite", "numel", "subnormal"}
    | {name for name in BLOCK_COLUMNS if name != "block_range"}
)
#: Column positions, by name (``row[AMAX]``).
AMAX, SCALE, OVERFLOW, UNDERFLOW, NONFINITE, NUMEL = range(len(BASE_COLUMNS))
SUM_SQ, ERR_SQ, SUBNORMAL, MIN_ABS = range(len(BASE_COLUMNS), len(BASE_COLUMNS) + len(QUALITY_COLUMNS))
#: How each column merges over micro-steps and ranks: the largest, the smallest, or the sum.
#: (``scale`` is the scale used, the same on every rank and micro-step of a step: max keeps it.)
MERGE: dict[str, str] = {
    "amax": "max",
    "scale": "max",
    "overflow": "sum",
    "underflow": "sum",
    "nonfinite": "sum",
    "numel": "sum",
    "sum_sq": "sum",
    "err_sq": "sum",
    "subnormal": "sum",
    "min_abs": "min",
    "blocks": "sum",
    "blocks_at_limit": "sum",
    "blocks_overflow": "sum",
    "blocks_underflow": "sum",
    "block_range": "max",
    "blocks_zero": "sum",
}

#: Largest finite value of each FP8 format (E5M2: 57344, not 57334).
FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}
#: Smallest normal and smallest subnormal magnitude of each FP8 format.
FP8_MIN_NORMAL: dict[str, float] = {"e4m3": 2.0**-6, "e5m2": 2.0**-14}
FP8_MIN_SUBNORMAL: dict[str, float] = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}
#: The range a format spans, in binades: log2(max / smallest subnormal) (E4M3 17.8, E5M2 31.8).
FP8_RANGE_BINADES: dict[str, float] = {f: math.log2(FP8_MAX[f] / FP8_MIN_SUBNORMAL[f]) for f in FP8_MAX}

# The quantities the quality columns stand for, as the dashboard and the detectors show them. Each takes
# numpy arrays (or floats) of the stored columns. A tensor with nothing to measure (all zero, or a layer that
# did not run: numel 0) gets the neutral value, never NaN: NaN stays the sign of a real non-finite value (or
# a missing column), and a neutral value cannot win a bucket's worst-of aggregation (min SQNR, max of the
# others) over a real one.


def sqnr_db(
    sum_sq: ArrayLike, err_sq: ArrayLike, numel: ArrayLike | None = None, nonfinite: ArrayLike | None = None
) -> np.ndarray:
    """Signal-to-quantization-noise ratio in dB, 10·log10(Σx² / Σ(q(x)−x)²) over the finite elements: +inf
    for an exact round trip (an all-zero tensor included: nothing was lost). Given ``numel`` and
    ``nonfinite``, NaN for a tensor without a finite element: its sums are zero because nothing was measured,
    and +inf would read as a perfect round trip of a tensor that is all NaN or Inf."""
    signal, noise = np.asarray(sum_sq, dtype=np.float64), np.asarray(err_sq, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        db = np.where((signal == 0) & (noise == 0), np.inf, 10.0 * np.log10(signal / noise))
    if numel is None or nonfinite is None:
        return db
    finite = np.asarray(numel, dtype=np.float64) - np.asarray(nonfinite, dtype=np.float64)
    return np.where(finite > 0, db, np.nan)


def no_finite_element(numel: ArrayLike, nonfinite: ArrayLike) -> np.ndarray:
    """Where a tensor had elements and none of them finite: the runtime's amax (which ignores NaN) reads 0 for
    one all NaN (stored as NaN, `stored_amax`) and its sums of squares are zero because nothing was
    measured, not because the tensor was zero."""
    numel = np.asarray(numel, dtype=np.float64)
    return (numel > 0) & (np.asarray(nonfinite, dtype=np.float64) >= numel)


def stored_amax(amax: ArrayLike, numel: ArrayLike, nonfinite: ArrayLike) -> np.ndarray:
    """The amax the service stores: the one sent, except NaN for a tensor whose elements were all NaN. The
    runtime's amax ignores NaN elements, as Transformer Engine's does (``fmaxf`` from 0), so such a tensor
    reports 0, the amax of a tensor of zeros; it has no amax, and NaN says so (a ``max(amax)`` over a run
    gone NaN is then NaN, not 0). Only there: a tensor with a finite element keeps the amax of its finite
    elements, and an Inf element makes the amax Inf as sent."""
    amax = np.asarray(amax, dtype=np.float64)
    return np.where(no_finite_element(numel, nonfinite) & (amax == 0), np.nan, amax)


def rms(sum_sq: ArrayLike, numel: ArrayLike, nonfinite: ArrayLike) -> np.ndarray:
    """Root mean square of the finite values (NaN when there are none)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.asarray(numel, dtype=np.float64) - np.asarray(nonfinite, dtype=np.float64)
        return np.sqrt(np.asarray(sum_sq, dtype=np.float64) / n)


def outlier_ratio(amax: ArrayLike, sum_sq: ArrayLike, numel: ArrayLike, nonfinite: ArrayLike) -> np.ndarray:
    """amax / RMS: how far the largest value stands above the bulk (1 for a constant tensor, an all-zero one
    included; an outlier feature shows as hundreds or thousands)."""
    top = np.asarray(amax, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(top == 0, 1.0, top / rms(sum_sq, numel, nonfinite))


def dynamic_range(amax: ArrayLike, min_abs: ArrayLike) -> np.ndarray:
    """log2(amax / smallest non-zero |x|): the binades the tensor spans, to compare with the format's
    (`FP8_RANGE_BINADES`); 0 when the tensor has no non-zero value (`min_abs` +inf)."""
    smallest = np.asarray(min_abs, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.isposinf(smallest), 0.0, np.log2(np.asarray(amax, dtype=np.float64) / smallest))


def subnormal_fraction(subnormal: ArrayLike, numel: ArrayLike) -> np.ndarray:
    """The share of values that land on FP8 subnormals (≤ 3 significant bits in E4M3, ≤ 2 in E5M2); 0 for a
    tensor with no values."""
    count, n = np.asarray(subnormal, dtype=np.float64), np.asarray(numel, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n == 0, 0.0, count / n)


def block_fraction(count: ArrayLike, blocks: ArrayLike) -> np.ndarray:
    """The share of a tensor's blocks a block count stands for (``blocks_at_limit``, ``blocks_overflow``,
    ``blocks_underflow``); 0 for a tensor with no blocks (per-tensor scaled, or a layer that did not run)."""
    c, n = np.asarray(count, dtype=np.float64), np.asarray(blocks, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n == 0, 0.0, c / n)
