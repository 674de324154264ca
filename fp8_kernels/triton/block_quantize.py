"""Block-scaled quantization in Triton: one pass over a 2-D tensor writes the FP8 data and one ``scale_inv``
per block, and with statistics folds every block's statistics into the step's statistics row and block row,
in one more launch of one program: no per-block output, no eager op, no host read.

Contract: ``reference.block_quantize.quantize_blocks`` bit for bit (the FP8 data and ``scale_inv``) for
row-wise ``1 x B`` blocks (MXFP8's 1x32 with E8M0 scales, FP8 block scaling's 1x128 with float32 scales)
and square ``B x B`` blocks (32x32 E8M0, 128x128 float32), any size (a partial block at an edge is a block
of the elements that exist). The numerics, per block, are the reference's (its module docstring):

* amax: a max over the bit patterns of ``|x|`` with NaN patterns read as 0 (NaN ignored, Inf kept), the
  same on every backend (``triton.launch.amax_bits``).
* E8M0: ``v = amax * float32(1 / FP8_MAX)``, rounded up to a power of two on its bits (subnormal ``v`` at
  or below 2^-127: code 0; Inf: 254); the multiplier ``2^(127 - code)`` built from bits (2^-127 for 254).
* float32: ``max(amax, amax_epsilon)``, ``FP8_MAX / amax`` correctly rounded (``div_rn``), the input
  dtype's largest finite value where that overflows, 1 for a zero or Inf amax, optionally the mantissa
  cleared; ``scale_inv = 1 / scale`` correctly rounded.
* ``q = fp8_satfinite(x * scale)``: the float32 product clamped to ``+-FP8_MAX`` (NaN kept), rounded to the
  format *arithmetically*, the sign put back on the bits, then cast (``triton.quantize._fp8_rounded``): the
  cast only meets values the format holds exactly, so it cannot round differently on a GPU and under the
  interpreter (whose float8 cast rounds some values wrongly).

Statistics (``stats`` and ``block_stats`` given: the step's ``STAT_COLUMNS`` row, 10 or 6 float64, and its
``(BLOCK_WIDTH,)`` block row, ``fp8_trainer.block_linear``), the values of
``fp8_trainer.block_linear.block_tensor_stats`` merged as ``merge_block_row`` merges them:

* each program quantizes ``T`` consecutive tiles (``tiles_per_program``) and computes their blocks' amax,
  scale exponent, counts (overflow: finite values whose cast saturated; underflow: finite non-zero values
  quantized to zero; non-finite; subnormal: landed on a non-zero FP8 subnormal), dynamic range (as
  ``max |x| / min |x|`` over the finite non-zero values, a float64 division: log2 is monotone, so the
  largest ratio gives the largest range) and whether the scale sits at a limit of its format; it folds
  them into one record of ``PARTS`` float64 (``_SLOTS``: a max, a min or a sum per slot) and adds its
  blocks' scale exponents to the block row's histogram bins, one masked float64 atomic add per non-empty
  bin (whole numbers: exact and independent of order);
* ``_block_fold_kernel`` (one program, after the first in stream order) reduces the records in a fixed
  order and merges the totals into the two rows: amax ``fmax`` with the scale of the block holding it (a
  block's scale is a function of its amax, so that is the scale of the call's amax) taken where the call's
  amax is at least the row's, counts and sums added, ``min_abs`` ``fmin``, ``block_range`` ``fmax`` of
  ``float32(log2(largest ratio))``. The sums of squares are float64 sums of the reference's float64 terms in
  another order (the error ``q * scale_inv - x`` in float32 as the reference computes it, which a GPU may
  contract into one FMA): compared within a bound, never bit for bit, but the same from run to run (no
  atomic adds in them). Everything else is exact.

On a GPU a program takes one tile (4096 elements) without statistics and with them enough tiles to keep the
records at most ``RECORDS`` (2048 records: 32 KiB for the fold to read, 16 loads of its 128 x 16 chunk).

Host side: no value is read on the host, and everything a call shape decides (the constexprs, grid, tile,
float32 constants) is built once per ``(shape, dtypes, block, scale format, options)`` (``_plan``); a call
checks its arguments, allocates its outputs and launches.

Memory access: a tile is ``TILE_M`` rows of one 1 x B column of blocks, or one B x B block; a program's
tiles are consecutive along the block columns; a tile wholly inside the tensor loads and stores with no
mask (16-byte vectors where rows start aligned, made visible by the ``DIV_N`` constexpr as in
``triton.launch``), edge tiles masked. The transpose of a row-major tensor (``x.t()``, the input of a
column-wise copy) is read in place (``X_T``): its tiles are contiguous along their rows, which Triton's
layout follows with 16-byte loads (``DIV_M`` makes the row length's alignment visible), so the copy costs no
``contiguous()`` pass first; the FP8 output is row-major either way.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from fp8_protocol.stats import BASE_COLUMNS, BLOCK_COLUMNS, BLOCK_HIST_BINS, STAT_COLUMNS

from ..reference.block_quantize import BlockQuantized
from ..reference.quantize import KERNEL_MAX_NUMEL, fp8_max
from .launch import abs_bits, as_kernel_input, divisor, format_constants, launch, load_f32
from .quantize import _fp8_rounded

__all__ = ["PARTS", "block_quantize_triton", "block_tile"]


def _f32(v: float) -> float:
    """``v`` rounded to float32 (nearest even), as the reference's float32 tensors hold it: in Python, no
    tensor."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def block_tile(device: torch.device, block: tuple[int, int]) -> tuple[int, int]:
    """``(TILE_M, num_warps)``: rows of 1 x B blocks per program (4096 elements on a GPU), or for a square
    block the block itself."""
    bm, bn = block
    if bm > 1:
        return bm, (16 if device.type == "cuda" and bm * bn >= 16384 else 4)
    return (4096 // bn, 8) if device.type == "cuda" else (16, 4)


@triton.jit
def _block_reduce_max(v, TWO_D: tl.constexpr):
    if TWO_D:
        return tl.max(tl.max(v, axis=1), axis=0)
    else:
        return tl.max(v, axis=1)


@triton.jit
def _block_reduce_min(v, TWO_D: tl.constexpr):
    if TWO_D:
        return tl.min(tl.min(v, axis=1), axis=0)
    else:
        return tl.min(v, axis=1)


@triton.jit
def _block_reduce_sum(v, TWO_D: tl.constexpr):
    if TWO_D:
        return tl.sum(tl.sum(v, axis=1), axis=0)
    else:
        return tl.sum(v, axis=1)


@triton.jit
def _per_row(v, TWO_D: tl.constexpr):
    """A per-block value broadcast against the tile."""
    if TWO_D:
        return v
    else:
        return v[:, None]


@triton.jit
def _scales(
    amax,
    FMAX: tl.constexpr,
    RCP_FMAX: tl.constexpr,
    E8M0: tl.constexpr,
    POW2_SCALE: tl.constexpr,
    AMAX_EPS: tl.constexpr,
    INPUT_MAX: tl.constexpr,
):
    """``(scale, scale_inv as float32, scale_inv as stored)`` of blocks with float32 ``amax`` (never NaN)."""
    if E8M0:
        v = amax * RCP_FMAX
        bits = v.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        up = (mantissa > 0) & (exponent != 254) & ~((exponent == 0) & (mantissa <= 0x400000))
        code = exponent + up.to(tl.int32)
        code = tl.where(bits == 0x7F800000, 254, code)  # Inf
        scale_bits = tl.where(code == 254, 0x00400000, (254 - code) << 23)
        inv_bits = tl.where(code == 0, 0x00400000, code << 23)
        return (
            scale_bits.to(tl.float32, bitcast=True),
            inv_bits.to(tl.float32, bitcast=True),
            code.to(tl.uint8),
        )
    else:
        a = tl.where(amax < AMAX_EPS, AMAX_EPS, amax)
        s = tl.math.div_rn(FMAX + tl.zeros_like(a), a)
        s = tl.where(s.to(tl.int32, bitcast=True) == 0x7F800000, INPUT_MAX, s)
        s = tl.where((a == 0) | (a.to(tl.int32, bitcast=True) == 0x7F800000), 1.0, s)
        if POW2_SCALE:
            s = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # 0xFF800000
        inv = tl.math.div_rn(1.0 + tl.zeros_like(s), s)
        return s, inv, inv


@triton.jit
def _fold_max(v, TWO_D: tl.constexpr):
    """A per-block value's largest over the tile's blocks (a square block is the tile)."""
    if TWO_D:
        return v
    else:
        return tl.max(v, axis=0)


@triton.jit
def _fold_min(v, TWO_D: tl.constexpr):
    if TWO_D:
        return v
    else:
        return tl.min(v, axis=0)


@triton.jit
def _fold_sum(v, TWO_D: tl.constexpr):
    if TWO_D:
        return v
    else:
        return tl.sum(v, axis=0)


#: Float64 slots of a program's record (``_SLOTS``, in this order), and the record's stride.
_SLOTS = (
    "amax",
    "ratio",
    "min_abs",
    "sum_sq",
    "err_sq",
    "overflow",
    "underflow",
    "nonfinite",
    "subnormal",
    "blocks_overflow",
    "blocks_underflow",
    "blocks_at_limit",
    "blocks_zero",
)
PARTS = 16


@triton.jit
def _tile(
    x_ptr,
    q_ptr,
    scale_inv_ptr,
    tm,
    tn,
    M,
    N,
    GN,
    MASKED: tl.constexpr,
    TWO_D: tl.constexpr,
    E8M0: tl.constexpr,
    POW2_SCALE: tl.constexpr,
    AMAX_EPS: tl.constexpr,
    INPUT_MAX: tl.constexpr,
    RCP_FMAX: tl.constexpr,
    FMAX: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr,
    OVF_INCLUSIVE: tl.constexpr,
    SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    QUALITY: tl.constexpr,
    STATS: tl.constexpr,
    IS_BF16: tl.constexpr,
    X_T: tl.constexpr,
    TILE_M: tl.constexpr,
    BN: tl.constexpr,
):
    rm = tm * TILE_M + tl.arange(0, TILE_M)
    rn = tn * BN + tl.arange(0, BN)
    offs = rm[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N) if MASKED else None
    # masked-out elements: 0, which counts as nothing; ``X_T``: x is the transpose of a row-major (N, M)
    # tensor, read in place (contiguous along the tile's rows)
    x = load_f32(x_ptr, rn[None, :] * M + rm[:, None] if X_T else offs, mask, IS_BF16)
    ax_bits = abs_bits(x)
    finite = ax_bits < 0x7F800000
    amax = _block_reduce_max(tl.where(ax_bits > 0x7F800000, 0, ax_bits), TWO_D).to(tl.float32, bitcast=True)
    scale, inv, stored = _scales(amax, FMAX, RCP_FMAX, E8M0, POW2_SCALE, AMAX_EPS, INPUT_MAX)
    xs = x * _per_row(scale, TWO_D)
    q8, q = _fp8_rounded(xs, q_ptr.dtype.element_ty, FMAX, MIN_NORMAL, SUB_MAGIC, DROP)
    tl.store(q_ptr + offs, q8, mask=mask)
    # one scale_inv per row of the tile (1 x B blocks) or one for the tile (a B x B block); float32 scales
    # of 1 x B blocks outer-dim-major (the (M, GN) grid stored as (GN, M): the GEMM's layout)
    if TWO_D:
        tl.store(scale_inv_ptr + tm * GN + tn, stored)
        valid = tm * TILE_M < M  # a square tile is a block that exists
    else:
        valid = rm < M
        if E8M0:
            tl.store(scale_inv_ptr + rm * GN + tn, stored, mask=valid)
        else:
            tl.store(scale_inv_ptr + tn * M + rm, stored, mask=valid)
    if STATS:
        r = tl.abs(q)  # |q| as float32 (meaningless for NaN, which is not finite)
        # per block: the dynamic range as a float64 ratio (0 for a block with no finite non-zero value)
        big = _block_reduce_max(tl.where(finite, ax_bits, 0), TWO_D)
        small = _block_reduce_min(tl.where(finite & (ax_bits != 0), ax_bits, 0x7F800000), TWO_D)
        big64 = big.to(tl.float32, bitcast=True).to(tl.float64)
        small64 = small.to(tl.float32, bitcast=True).to(tl.float64)
        ratio = tl.where(big > 0, big64 / tl.where(big > 0, small64, 1.0), 0.0)
        sa = tl.abs(xs)
        saturated = sa >= OVF_THRESHOLD if OVF_INCLUSIVE else sa > OVF_THRESHOLD
        overflow = _block_reduce_sum((saturated & finite).to(tl.int32), TWO_D)
        underflow = _block_reduce_sum((finite & (ax_bits != 0) & (r == 0)).to(tl.int32), TWO_D)
        nonfinite = _block_reduce_sum((~finite).to(tl.int32), TWO_D)
        # the scale exponent (histogram bin), and a scale pinned at a limit of its format for a block with
        # something to scale (``block_linear._scale_and_limit``); amax 0: a zero block (rows past M too)
        empty = amax == 0
        if E8M0:
            code = stored.to(tl.int32)
            at_limit = ((code == 0) | (code == 254)) & ~empty
        else:
            code = (stored.to(tl.int32, bitcast=True) >> 23) & 0xFF
            eff = tl.where(amax < AMAX_EPS, AMAX_EPS, amax)
            huge = tl.math.div_rn(FMAX + tl.zeros_like(eff), eff).to(tl.int32, bitcast=True) == 0x7F800000
            at_limit = ((eff == 0) | (eff.to(tl.int32, bitcast=True) == 0x7F800000) | huge) & ~empty
        # the tile's record (``_SLOTS``) and histogram of scale exponents
        rec = tl.zeros([16], dtype=tl.float64)
        slots = tl.arange(0, 16)
        rec = _slot(rec, slots, 0, _fold_max(tl.where(valid, amax, 0.0), TWO_D))
        rec = _slot(rec, slots, 1, _fold_max(ratio, TWO_D))
        rec = _slot(rec, slots, 2, _fold_min(small, TWO_D).to(tl.float32, bitcast=True))
        rec = _slot(rec, slots, 5, _fold_sum(overflow, TWO_D))
        rec = _slot(rec, slots, 6, _fold_sum(underflow, TWO_D))
        rec = _slot(rec, slots, 7, _fold_sum(nonfinite, TWO_D))
        rec = _slot(rec, slots, 9, _fold_sum((overflow > 0).to(tl.int32), TWO_D))
        rec = _slot(rec, slots, 10, _fold_sum((underflow > 0).to(tl.int32), TWO_D))
        rec = _slot(rec, slots, 11, _fold_sum(at_limit.to(tl.int32), TWO_D))
        rec = _slot(rec, slots, 12, _fold_sum((empty & valid).to(tl.int32), TWO_D))
        if QUALITY:
            af = tl.where(finite, tl.abs(x), 0.0).to(tl.float64)
            err = tl.where(finite, q * _per_row(inv, TWO_D) - x, 0.0).to(tl.float64)
            rec = _slot(rec, slots, 3, tl.sum(tl.sum(af * af, axis=1), axis=0))
            rec = _slot(rec, slots, 4, tl.sum(tl.sum(err * err, axis=1), axis=0))
            sub = (finite & (r > 0) & (r < SUBNORMAL_TOP)).to(tl.int32)
            rec = _slot(rec, slots, 8, tl.sum(tl.sum(sub, axis=1), axis=0))
        # (a square tile is one block: its code one-hot)
        hist = (tl.arange(0, 256) == code).to(tl.int32) if TWO_D else tl.histogram(code, 256, mask=valid)
        return rec, hist
    else:
        return tl.zeros([16], dtype=tl.float64), tl.zeros([256], dtype=tl.int32)


@triton.jit
def _slot(rec, slots, j: tl.constexpr, v):
    """``rec`` with slot ``j`` set to ``v`` (as float64)."""
    return tl.where(slots == j, v.to(tl.float64), rec)


@triton.jit(do_not_specialize=["M", "N", "T"])
def _block_quantize_kernel(
    x_ptr,
    q_ptr,
    scale_inv_ptr,
    part_ptr,
    hist_ptr,
    M,
    N,
    T,
    TWO_D: tl.constexpr,
    E8M0: tl.constexpr,
    POW2_SCALE: tl.constexpr,
    AMAX_EPS: tl.constexpr,
    INPUT_MAX: tl.constexpr,
    RCP_FMAX: tl.constexpr,
    FMAX: tl.constexpr,
    UNDERFLOW: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr,
    OVF_INCLUSIVE: tl.constexpr,
    SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    QUALITY: tl.constexpr,
    STATS: tl.constexpr,
    IS_BF16: tl.constexpr,
    X_T: tl.constexpr,
    DIV_M: tl.constexpr,
    DIV_N: tl.constexpr,
    TILE_M: tl.constexpr,
    BN: tl.constexpr,
):
    """``T`` consecutive tiles per program (tile ``t``: tile row ``t // GN``, block column ``t % GN``), their
    statistics folded into one record (slot-wise max, min or sum) and one histogram."""
    N = (N // DIV_N) * DIV_N  # exact (the launcher checked), and visible: rows start 16-element aligned
    M = (M // DIV_M) * DIV_M  # the same for the columns of a transposed input (``X_T``)
    GN = tl.cdiv(N, BN)
    n_tiles = tl.cdiv(M, TILE_M) * GN
    pid = tl.program_id(0)
    slots = tl.arange(0, 16)
    acc_sum = tl.zeros([16], dtype=tl.float64)
    acc_max = tl.zeros([16], dtype=tl.float64)
    acc_min = tl.full([16], float("inf"), dtype=tl.float64)
    acc_hist = tl.zeros([256], dtype=tl.int32)
    for i in range(T):
        t = pid * T + i
        tm = t // GN
        tn = t % GN
        if t < n_tiles:
            if ((tm + 1) * TILE_M <= M) & ((tn + 1) * BN <= N):
                rec, hist = _tile(
                    x_ptr,
                    q_ptr,
                    scale_inv_ptr,
                    tm,
                    tn,
                    M,
                    N,
                    GN,
                    False,
                    TWO_D,
                    E8M0,
                    POW2_SCALE,
                    AMAX_EPS,
                    INPUT_MAX,
                    RCP_FMAX,
                    FMAX,
                    OVF_THRESHOLD,
                    OVF_INCLUSIVE,
                    SUBNORMAL_TOP,
                    MIN_NORMAL,
                    SUB_MAGIC,
                    DROP,
                    QUALITY,
                    STATS,
                    IS_BF16,
                    X_T,
                    TILE_M,
                    BN,
                )
            else:
                rec, hist = _tile(
                    x_ptr,
                    q_ptr,
                    scale_inv_ptr,
                    tm,
                    tn,
                    M,
                    N,
                    GN,
                    True,
                    TWO_D,
                    E8M0,
                    POW2_SCALE,
                    AMAX_EPS,
                    INPUT_MAX,
                    RCP_FMAX,
                    FMAX,
                    OVF_THRESHOLD,
                    OVF_INCLUSIVE,
                    SUBNORMAL_TOP,
                    MIN_NORMAL,
                    SUB_MAGIC,
                    DROP,
                    QUALITY,
                    STATS,
                    IS_BF16,
                    X_T,
                    TILE_M,
                    BN,
                )
            acc_sum += rec
            acc_max = tl.maximum(acc_max, rec)
            acc_min = tl.minimum(acc_min, rec)
            acc_hist += hist
    if STATS:
        # the program's record: amax and ratio the max, min_abs the min, the rest summed
        out = tl.where(slots == 2, acc_min, tl.where(slots <= 1, acc_max, acc_sum))
        tl.store(part_ptr + pid * 16 + slots, out)
        tl.atomic_add(hist_ptr + tl.arange(0, 256), acc_hist.to(tl.float64), mask=acc_hist > 0)


@triton.jit
def _pick(acc, cols, j: tl.constexpr):
    return tl.sum(tl.where(cols == j, acc, 0.0), axis=0)


@triton.jit(do_not_specialize=["programs", "numel", "blocks"])
def _block_fold_kernel(
    part_ptr,
    row_ptr,
    brow_ptr,
    programs,
    numel,
    blocks,
    E8M0: tl.constexpr,
    POW2_SCALE: tl.constexpr,
    AMAX_EPS: tl.constexpr,
    INPUT_MAX: tl.constexpr,
    RCP_FMAX: tl.constexpr,
    FMAX: tl.constexpr,
    QUALITY: tl.constexpr,
    NSLOTS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program: the ``programs`` records reduced (max, min or sum per slot, in a fixed order) and merged
    into the statistics row and the block row (module docstring)."""
    cols = tl.arange(0, 16)
    acc_sum = tl.zeros([16], dtype=tl.float64)
    acc_max = tl.zeros([16], dtype=tl.float64)
    acc_min = tl.full([16], float("inf"), dtype=tl.float64)
    for start in range(0, programs, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        m = (rows[:, None] < programs) & (cols[None, :] < NSLOTS)
        v = tl.load(part_ptr + rows[:, None] * 16 + cols[None, :], mask=m, other=0.0)
        acc_sum += tl.sum(v, axis=0)
        acc_max = tl.maximum(acc_max, tl.max(v, axis=0))
        acc_min = tl.minimum(acc_min, tl.min(tl.where(m, v, float("inf")), axis=0))
    # amax: fmax, and the scale of the call's amax where it is at least the row's (or the row's is NaN)
    amax = _pick(acc_max, cols, 0)
    old = tl.load(row_ptr)
    takes = (amax >= old) | (old != old)
    tl.store(row_ptr, tl.where(takes, amax, old))
    scale, _inv, _stored = _scales(amax.to(tl.float32), FMAX, RCP_FMAX, E8M0, POW2_SCALE, AMAX_EPS, INPUT_MAX)
    tl.store(row_ptr + 1, tl.where(takes, scale.to(tl.float64), tl.load(row_ptr + 1)))
    tl.store(row_ptr + 2, tl.load(row_ptr + 2) + _pick(acc_sum, cols, 5))
    tl.store(row_ptr + 3, tl.load(row_ptr + 3) + _pick(acc_sum, cols, 6))
    tl.store(row_ptr + 4, tl.load(row_ptr + 4) + _pick(acc_sum, cols, 7))
    tl.store(row_ptr + 5, tl.load(row_ptr + 5) + numel.to(tl.float64))
    if QUALITY:
        tl.store(row_ptr + 6, tl.load(row_ptr + 6) + _pick(acc_sum, cols, 3))
        tl.store(row_ptr + 7, tl.load(row_ptr + 7) + _pick(acc_sum, cols, 4))
        tl.store(row_ptr + 8, tl.load(row_ptr + 8) + _pick(acc_sum, cols, 8))
        low = tl.min(tl.where(cols == 2, acc_min, float("inf")), axis=0)
        old_low = tl.load(row_ptr + 9)
        tl.store(row_ptr + 9, tl.where(old_low != old_low, low, tl.minimum(old_low, low)))
    # the block columns: blocks, at limit, overflowed, underflowed, range (fmax), zero
    tl.store(brow_ptr + 0, tl.load(brow_ptr + 0) + blocks.to(tl.float64))
    tl.store(brow_ptr + 1, tl.load(brow_ptr + 1) + _pick(acc_sum, cols, 11))
    tl.store(brow_ptr + 2, tl.load(brow_ptr + 2) + _pick(acc_sum, cols, 9))
    tl.store(brow_ptr + 3, tl.load(brow_ptr + 3) + _pick(acc_sum, cols, 10))
    ratio = _pick(acc_max, cols, 1)
    drange = tl.where(ratio > 0, tl.log2(tl.where(ratio > 0, ratio, 1.0)).to(tl.float32), 0.0).to(tl.float64)
    old_range = tl.load(brow_ptr + 4)
    tl.store(brow_ptr + 4, tl.where(old_range != old_range, drange, tl.maximum(old_range, drange)))
    tl.store(brow_ptr + 5, tl.load(brow_ptr + 5) + _pick(acc_sum, cols, 12))


# --- the launcher -------------------------------------------------------------------------------------------

#: call shape -> ``(grid, tiles per program, block grid rows, columns, kernel keywords, fold keywords)``
_PLANS: dict[tuple, tuple] = {}
#: At most this many records per call on a GPU (32 KiB for the fold to read): with statistics, a program
#: takes ``ceil(tiles / RECORDS)`` tiles (2 for a 4096 x 4096 MXFP8 tensor, 8 for 8192 x 8192)
RECORDS = 2048


def tiles_per_program(device_type: str, tiles: int, stats: bool) -> int:
    """Tiles per program: one without statistics on a GPU (the most programs), enough with them to keep
    the records at most ``RECORDS``; two on the CPU, so that the interpreter runs the loop over tiles and
    its remainder as a GPU does on a large tensor."""
    if device_type != "cuda":
        return 2
    return max(1, -(-tiles // RECORDS)) if stats else 1


def _plan(key: tuple) -> tuple:
    """What a call shape decides, built once: the grid, the tile, the constexprs of both kernels (float32
    constants rounded in Python: no tensor, no host read)."""
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    device_type, M, N, dtype, fp8_dtype, (bm, bn), scale_format, pow2, eps, stats, quality, x_t, _ = key
    gm, gn = -(-M // bm), -(-N // bn)
    tile_m, warps = block_tile(torch.device(device_type), (bm, bn))
    e8m0 = scale_format == "e8m0"
    scales = dict(
        E8M0=e8m0,
        POW2_SCALE=pow2,
        AMAX_EPS=_f32(eps),
        INPUT_MAX=float(torch.finfo(dtype).max),
        RCP_FMAX=_f32(1.0 / fp8_max(fp8_dtype)),
        FMAX=fp8_max(fp8_dtype),
    )
    kernel = dict(
        **format_constants(fp8_dtype) | scales,
        TWO_D=bm > 1,
        QUALITY=quality,
        STATS=stats,
        IS_BF16=dtype == torch.bfloat16,
        X_T=x_t,
        DIV_M=divisor(M) if x_t else 1,
        DIV_N=divisor(N),
        TILE_M=tile_m,
        BN=bn,
        num_warps=warps,
    )
    fold = dict(
        scales, QUALITY=quality, NSLOTS=len(_SLOTS), CHUNK=128 if device_type == "cuda" else 4, num_warps=4
    )
    tiles = -(-M // tile_m) * gn
    per_program = tiles_per_program(device_type, tiles, stats)
    plan = (-(-tiles // per_program), per_program, gm, gn, kernel, fold)
    _PLANS[key] = plan
    return plan


def _check_rows(stats: torch.Tensor, block_stats: torch.Tensor, device: torch.device) -> bool:
    """Whether the rows are ones the fold kernel writes (float64, contiguous, on ``device``); returns
    ``quality`` (a 10-column row)."""
    for name, t, widths in (
        ("stats", stats, (len(STAT_COLUMNS), len(BASE_COLUMNS))),
        ("block_stats", block_stats, (len(BLOCK_COLUMNS) + BLOCK_HIST_BINS,)),
    ):
        if t.dtype != torch.float64 or t.dim() != 1 or t.shape[0] not in widths or t.stride(0) != 1:
            raise ValueError(
                f"{name}: expected a contiguous float64 row of {' or '.join(map(str, widths))} columns, "
                f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}"
            )
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device}")
    return stats.shape[0] == len(STAT_COLUMNS)


def block_quantize_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    block: tuple[int, int],
    scale_format: str,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    stats: torch.Tensor | None = None,
    block_stats: torch.Tensor | None = None,
) -> BlockQuantized:
    """Triton twin of ``quantize_blocks`` (same arguments, same bits).

    ``block`` ``(1, B)`` or ``(B, B)``. ``scale_inv`` holds the reference's values; float32 scales of
    ``(1, B)`` blocks are stored outer-dim-major (a transposed view, strides ``(1, rows)``: the layout the
    native block-scaled GEMM takes), the others row-major. With ``stats`` (the step's statistics row, 10
    or 6 float64) and ``block_stats`` (its block row, ``BLOCK_WIDTH`` float64) the quantization's
    statistics are merged into both (module docstring): the values
    ``fp8_trainer.block_linear.record_block_stats`` merges from the reference.
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got shape {tuple(x.shape)}")
    if scale_format not in ("e8m0", "fp32"):
        raise ValueError(f"scale_format: expected 'e8m0' or 'fp32', got {scale_format!r}")
    bm, bn = block
    if not (bm == 1 or bm == bn) or bn < 16 or bn & (bn - 1):
        raise ValueError(f"block: expected (1, B) or (B, B) with B a power of two >= 16, got {block}")
    if x.numel() > KERNEL_MAX_NUMEL:
        raise ValueError(f"x: {x.numel()} elements exceed the Triton kernel's limit of {KERNEL_MAX_NUMEL}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x: expected float32, bfloat16 or float16, got {x.dtype}")
    if (stats is None) != (block_stats is None):
        raise ValueError("stats, block_stats: give both rows or neither")
    dev = x.device
    quality = stats is not None and _check_rows(stats, block_stats, dev)
    M, N = x.shape
    # the transpose of a row-major tensor (a column-wise copy's input) is read in place, not copied
    x_t = not x.is_contiguous() and x.stride() == (1, M)
    key = (
        dev.type,
        M,
        N,
        x.dtype,
        fp8_dtype,
        (bm, bn),
        scale_format,
        bool(power_2_scale),
        amax_epsilon,
        stats is not None,
        quality,
        x_t,
        block_tile,
    )
    grid, per_program, gm, gn, kernel, fold = _plan(key)
    q = torch.empty((M, N), dtype=fp8_dtype, device=dev)
    if scale_format == "e8m0":
        scale_inv = torch.empty((gm, gn), dtype=torch.uint8, device=dev)
    elif bm == 1:  # outer-dim-major, as the native GEMM takes 1 x 128 scales (``block_gemm._vec128_scale``)
        scale_inv = torch.empty((gn, gm), dtype=torch.float32, device=dev).t()
    else:
        scale_inv = torch.empty((gm, gn), dtype=torch.float32, device=dev)
    if M and N:
        xc, _ = as_kernel_input(x.t() if x_t else x)  # a transposed input: its row-major original
        # one record per program (uninitialised: every program writes its own), the histogram in the row
        parts = (
            torch.empty((grid, PARTS), dtype=torch.float64, device=dev) if stats is not None else scale_inv
        )
        hist = block_stats[-BLOCK_HIST_BINS:] if stats is not None else scale_inv
        launch(_block_quantize_kernel, grid, xc, q, scale_inv, parts, hist, M, N, per_program, **kernel)
        if stats is not None:
            launch(_block_fold_kernel, 1, parts, stats, block_stats, grid, M * N, gm * gn, **fold)
    return BlockQuantized(q, scale_inv, (bm, bn), scale_format)
