"""Fused quantize + statistics in one pass over the input (Triton), delayed or current scaling.

Contract: exactly ``reference.quantize.quantize_with_stats_reference`` (same statistics row, same bits):
each element is read once, ``v = clamp(x * scale, -FP8_MAX, FP8_MAX)`` (NaN kept) is computed in float32 and
cast to FP8 with round-to-nearest-even, and the element's contribution to the statistics is counted from
``|x|`` and ``|x * scale|`` on the way. Optionally the same pass writes the transposed FP8 tensor (the
operand layout the backward GEMMs want) and, for tests, the pre-cast values ``v`` themselves.

NaN and the amax: ``amax`` is a float max with ``maxnumf`` semantics (``tl.maximum``: ``max.f32`` on a GPU,
``np.fmax`` in the interpreter), under which a NaN loses to any number, so NaN elements are ignored
(Transformer Engine's ``fmaxf``) and Inf is kept, identically on both (the propagating ``maximumf`` would
not do). The float64 ``amax`` column is accumulated across calls with an integer atomic max on its bits
(integer order equals float order for non-negative floats). Counts are float64 atomic adds of integers,
exact below 2**53 and independent of order. Per element a program keeps two 32-bit accumulators: the amax,
and the four counts packed 8 bits apart (an element is at most one of overflow, underflow, non-finite,
subnormal; ``persistent_grid`` gives no program more than ``MAX_BLOCKS_PER_PROGRAM`` < 2**8 blocks), which
saves the registers of four separate accumulators.

The FP8 cast: where the float32 -> FP8 cast saturates by itself (``saturating_cast``: CUDA sm_89+, whose
``cvt.rn.satfinite`` maps values beyond ``FP8_MAX`` and infinities to ``+-FP8_MAX`` and keeps NaN) it is
the cast alone, one instruction per pair of elements. Elsewhere (the interpreter, whose float8 cast
rounds some values wrongly, docs/fp8-semantics.md "Known traps"; ROCm) ``v`` is rounded to the format
*arithmetically* (``_round_fp8``: a mantissa rounding on the bits for normals, the add of a power of two for
subnormals) and the cast meets only values the format holds, so the bits are the reference's on both.

Quality statistics (``QUALITY``, a 10-column row; a 6-column row skips them) come from the same values:
per element ``|x * scale|`` of the finite elements (0 for NaN/Inf), its square, and the square of its
round-trip error ``|q| - |x * scale|`` with ``|q|`` the FP8 value of ``|x * scale|`` as float32 (the cast
is symmetric in the sign: the magnitude of the value just written; for NaN/Inf the cast of 0, so the error
is 0 with no select).

Accumulators: every statistic is folded per run of ``LANE`` (8) consecutive elements into one slot
(``_runs``): a run lies in one thread's registers, so nothing crosses threads until the program's end (no
shuffle or barrier per block), and the accumulators are 8 times narrower than a block. The squares of a
run are summed in float32 and added to the run's float64 slot (within (LANE - 1) * 2**-24 relative); a
program whose float32 squares left the float32 range (an ``|x * scale|`` above 1.8e19, which a stale scale
meeting a spike reaches, or a sum below 2^-100) takes its sums again in float64 after its main loop
(``_exact_sums_1d`` / ``_exact_sums_2d``, as the reference takes them), so both stay finite and exact for
every finite tensor while the main loop keeps its float32 registers; counts
are packed 8 bits apart per slot, each at most ``LANE * MAX_BLOCKS_PER_PROGRAM`` < 2**8. ``min_abs`` is a
min over the bits of ``|x|`` minus one, unsigned, so that zeros (which wrap) and non-finite elements
never win (``_min_abs_bits``), folded into the row with an integer atomic min on the float64 bits.

sm_90 SASS of the main loops (bf16 in, ``bench/sass.py``; Triton 3.9), per 16 elements of a thread: from
the block-wise tree reductions, the clamp and the re-rounding for the error, bit-pattern amax and OR-packed
counts, the error from the cast of ``|x * scale|`` and one underflow compare, to now: 1-D with quality 899 ->
435 instructions, 4 -> 0 barriers, 139 -> 102 registers; 1-D without 340 -> 247, 94 -> 62 registers; 2-D
with quality 1095 -> 513, 88 bytes of spills -> none; 2-D without 582 -> 360 -> 276 (the last step: tiles
of 64 x 64 for 4 warps, two rows of 16 per thread, so that a tile's transpose moves 16-bit words, read back
with ``ldmatrix.trans`` instead of 16 single-byte shared loads per thread; no integer division per tile; 3
programs per SM where one 16-warp program of 128 x 64 tiles filled it). ``tests/kernels/test_ptx.py`` holds
the budgets.

The 2-D (tiled) kernel takes a tile as its two halves, the even rows and the odd rows (``_pair_offsets``):
one thread holds rows ``2i`` and ``2i + 1`` of the same 16 columns, which makes each column's pair one
16-bit word of the transposed output (``_store_transposed``; where ``M`` is not a multiple of 16 the halves
are interleaved back and transposed byte by byte). Its programs form a ``PM x PN`` grid
(``triton.launch.grid_2d``): program ``(pm, pn)`` walks tile columns ``pn, pn + PN, ...`` and in each the tile
rows ``pm, pm + PM, ...``. With ``DBIAS`` (the bias gradient of ``grad_output``, ``x.sum(0)``, Transformer
Engine's cast-transpose-dbias) a program adds its tiles of a column element by element into float32
registers (one add per element, nothing across threads per tile), reduces them across its rows once per
column and writes them to a workspace row; the column's last program to arrive adds the ``PM`` rows in a
fixed order and writes the result in ``x``'s dtype (``_flush_column_sums``): one launch, ``x`` read once,
the same bits whichever program finishes last. The 1-D entry with ``dbias`` runs this kernel without the
transposed output.

Memory access: the 1-D kernel walks full ``BLOCK``s with no mask and one masked tail block; the 2-D kernel
walks each column's full tiles with no mask, then its edge tiles (the last tile row; every tile of the last
tile column) masked. Unmasked blocks
at multiples of ``BLOCK`` let the compiler emit 16-byte vector loads and stores; for the 2-D kernel rows must
also start aligned, which the launcher makes visible with the ``DIV_M`` / ``DIV_N`` constexprs
(``triton.launch``). Nothing depends on a hint for correctness: the masked paths handle every size. A
program keeps loads in flight while it works: the shipped form (``triton.launch.prefetch``) loads its next
block (tile) into registers before working on the current one; the other (``PREFETCH`` off) leaves the loop
to Triton's software pipeline (``tl.range(num_stages=STAGES)``, ``triton.launch.pipeline_stages``), whose
sm_90 build copies blocks into shared memory asynchronously, ``STAGES - 1`` ahead, and holds none in
registers. Both visit the same blocks in the same order; ``bench/kernels.py`` times them side by side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.quantize import BASE_COLUMNS, KERNEL_MAX_NUMEL, STAT_COLUMNS, check_dbias_operand, new_stats
from .launch import (
    LANE,
    PreparedLaunch,
    abs_bits,
    as_kernel_input,
    block_1d,
    cdiv,
    divisor,
    format_constants,
    grid_2d,
    launch,
    load_f32,
    persistent_grid,
    pipeline_stages,
    prefetch,
    saturating_cast,
    tile_2d,
    to_f32,
)

__all__ = [
    "PreparedQuantize",
    "launch_quantize",
    "prepare_quantize",
    "quantize_with_stats_transposed_triton",
    "quantize_with_stats_triton",
]

MAX_NUMEL = KERNEL_MAX_NUMEL


@triton.jit
def _round_fp8(r, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, DROP: tl.constexpr):
    """A non-negative float32 ``r <= FP8_MAX`` rounded to the FP8 format, to nearest even, as a float32.
    Normals: the mantissa cut to ``23 - DROP`` bits on the bits (a carry moves into the exponent, as it
    should). Subnormals (fixed quantum, the smallest subnormal): ``(r + SUB_MAGIC) - SUB_MAGIC`` with
    ``SUB_MAGIC`` = smallest subnormal * 2**23, whose float32 ulp is that quantum."""
    bits = r.to(tl.int32, bitcast=True)
    half = (1 << (DROP - 1)) - 1
    normal = ((bits + half + ((bits >> DROP) & 1)) & -(1 << DROP)).to(tl.float32, bitcast=True)
    subnormal = (r + SUB_MAGIC) - SUB_MAGIC
    return tl.where(r < MIN_NORMAL, subnormal, normal)


@triton.jit
def _scale_and_count(
    x,
    scale,
    FMAX: tl.constexpr,
    UNDERFLOW: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr,
    OVF_INCLUSIVE: tl.constexpr,
    SUBNORMAL_TOP: tl.constexpr,
    QUALITY: tl.constexpr,
):
    """One element's ``(|x|, packed counts, pre-cast value, |x * scale| of a finite x else 0)``: the counts
    overflow, underflow, non-finite and subnormal exclude each other, so one int32 holds them, 8 bits
    apart."""
    ax_bits = abs_bits(x)
    finite = ax_bits < 0x7F800000  # exponent all ones: Inf or NaN
    xs = x * scale
    a = tl.abs(xs)
    # E5M2: the midpoint above FP8_MAX rounds up (to Inf); E4M3: it rounds down to FP8_MAX
    big = a >= OVF_THRESHOLD if OVF_INCLUSIVE else a > OVF_THRESHOLD
    af = tl.where(finite, a, 0.0)
    # at most one field set, as nested selects of the packed values: subnormal (lands on a non-zero FP8
    # subnormal; QUALITY only), overflow (a finite x's product may have overflowed to Inf), underflow
    # (non-zero, rounds to zero), and non-finite over all of them. One compare with the underflow threshold
    # serves both sides of it: a NaN product, which fails it, comes from a NaN x (the scale is finite and
    # positive), whose non-finite select comes last
    above = a > UNDERFLOW
    if QUALITY:
        counts = tl.where(above & (a < SUBNORMAL_TOP), 1 << 24, 0)
        counts = tl.where(big, 1, counts)
    else:
        counts = tl.where(big, 1, 0)
    counts = tl.where((~above) & (ax_bits != 0), 256, counts)
    counts = tl.where(finite, counts, 1 << 16)
    return tl.abs(x), counts, xs, af


@triton.jit
def _clamp(xs, FMAX: tl.constexpr):
    """``clamp(xs, -FMAX, FMAX)``, NaN kept (explicitly: a GPU's min/max would turn NaN into the bound)."""
    return tl.where(xs != xs, xs, tl.minimum(tl.maximum(xs, -FMAX), FMAX))


@triton.jit
def _fp8_rounded(
    xs, dtype, FMAX: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, DROP: tl.constexpr
):
    """``xs`` clamped to ``+-FMAX`` and rounded to the FP8 format on the float32 bits (``_round_fp8``), then
    cast: ``(q in dtype, q as float32)``. The cast meets only values the format holds, so it cannot round
    differently on a GPU and under the interpreter (whose float8 cast rounds some values wrongly). NaN gets
    the format's NaN pattern ``0x7F`` with its sign, as torch's cast (its float32 value is meaningless)."""
    r = _round_fp8(tl.minimum(tl.abs(xs), FMAX), MIN_NORMAL, SUB_MAGIC, DROP)
    sign = xs.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000
    qf = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    q_bits = qf.to(dtype).to(tl.uint8, bitcast=True)
    q_bits = tl.where(xs != xs, ((sign >> 24) & 0x80 | 0x7F).to(tl.uint8), q_bits)
    return q_bits.to(dtype, bitcast=True), qf


@triton.jit
def _to_fp8(
    xs,
    dtype,
    FMAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    SAT_CAST: tl.constexpr,
):
    """``xs`` in the FP8 ``dtype``, saturated (``clamp(xs, -FMAX, FMAX)``, NaN kept, rounded to nearest
    even): ``(q, q as float32)``, the second for the quality statistics (unused otherwise: it costs
    nothing). ``SAT_CAST`` where the cast itself does all that (sm_89+: ``cvt.rn.satfinite``, values beyond
    the format's largest finite value and infinities become it with their sign, NaN stays NaN): one
    instruction per pair of elements, the float32 value read back from ``q``; elsewhere (the interpreter,
    ROCm) ``_fp8_rounded``."""
    if SAT_CAST:
        q = xs.to(dtype)
        return q, q.to(tl.float32)
    else:
        return _fp8_rounded(xs, dtype, FMAX, MIN_NORMAL, SUB_MAGIC, DROP)


@triton.jit
def _quality_terms(x, qa, af, sq_acc, err_acc, min_acc):
    """The quality accumulators (one slot per run of ``LANE`` elements, ``_runs``) after one block or tile:
    ``+ sum(af**2)``, ``+ sum((qa - af)**2)`` with ``qa`` the FP8 value of ``af`` as float32 (``_to_fp8``;
    the scaled domain; each run's float32 sum added to its float64 slot), ``min`` with the bits of ``|x|``
    minus one, unsigned (``_min_abs_bits``). ``qa`` is ``|q|`` for a finite ``x`` (the cast is symmetric in
    the sign) and 0 for a non-finite one, whose ``af`` is 0: its error is 0 with no select."""
    bits = abs_bits(x)
    d = qa - af
    low_bits = (bits - 1).to(tl.uint32, bitcast=True)  # see _min_abs_bits
    sq, err, low = tl.reduce((_runs(af * af), _runs(d * d), _runs(low_bits)), len(x.shape), _sum_sum_min)
    return sq_acc + sq.to(tl.float64), err_acc + err.to(tl.float64), tl.minimum(min_acc, low)


@triton.jit
def _needs_exact(sq, err, low):
    """Whether a program's float32 sums of squares cannot stand: one overflowed to +inf (a finite
    ``|x * scale|`` above 1.8e19), or a sum is below 2^-100 while a non-zero finite element was there
    (``low``, the min of ``abs_bits(x) - 1``, below Inf's bits - 1): its terms may have lost their bits,
    float32 squares below 2^-126 being subnormal and below 2^-149 zero. At or above 2^-100 what they lose
    is at most 2^-149 each, nothing next to the sum."""
    out_of_range = (sq > 1.7976931348623157e308) | (err > 1.7976931348623157e308)
    tiny = (sq < 7.888609052210118e-31) | (err < 7.888609052210118e-31)
    return out_of_range | (tiny & (low < 0x7F7FFFFF))


@triton.jit
def _exact_terms(
    x,
    scale,
    dtype,
    FMAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    SAT_CAST: tl.constexpr,
):
    """``(a**2, (|q| - a)**2)`` per element in float64, as the reference takes them: ``a = |x * scale|``
    (float32) of a finite ``x``, its exact float64 product where the float32 one overflowed, 0 for NaN /
    Inf; ``|q|`` the FP8 value of ``a``."""
    finite = abs_bits(x) < 0x7F800000
    af = tl.where(finite, tl.abs(x * scale), 0.0)
    _, qa = _to_fp8(af, dtype, FMAX, MIN_NORMAL, SUB_MAGIC, DROP, SAT_CAST)
    exact = tl.abs(x).to(tl.float64) * scale.to(tl.float64)
    a = tl.where(af > 3.4028234663852886e38, exact, af.to(tl.float64))
    d = qa.to(tl.float64) - a
    return a * a, d * d


@triton.jit
def _exact_sums_1d(
    x_ptr,
    q_ptr,
    n,
    scale,
    FMAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    SAT_CAST: tl.constexpr,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """This program's two sums of squares again, in float64 (``_needs_exact``): its blocks of the 1-D
    kernel's round robin, the partial one included. Rare: a plain masked loop, an eighth of a block at a time
    (float64 values of a whole block would raise the kernel's register count, which its main loop sets)."""
    SUB: tl.constexpr = BLOCK // 8
    lanes = tl.arange(0, SUB)
    sq = tl.zeros([SUB], dtype=tl.float64)
    err = tl.zeros([SUB], dtype=tl.float64)
    for b in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        for c in range(0, BLOCK, SUB):
            offs = b * BLOCK + c + lanes
            x = load_f32(x_ptr, offs, offs < n, IS_BF16)
            dtype = q_ptr.dtype.element_ty
            s, e = _exact_terms(x, scale, dtype, FMAX, MIN_NORMAL, SUB_MAGIC, DROP, SAT_CAST)
            sq += s
            err += e
    return tl.sum(sq, axis=0), tl.sum(err, axis=0)


@triton.jit
def _min_abs_bits(low):
    """The bits of the smallest non-zero finite ``|x|`` (Inf's where there is none) from the unsigned min of
    ``abs_bits(x) - 1`` (``_quality_terms``): a zero wraps to the largest uint32 and a non-finite element
    is at least Inf's bits - 1, so neither can be the min unless nothing else was there."""
    return (tl.minimum(low, 0x7F7FFFFF) + 1).to(tl.int32, bitcast=True)


@triton.jit
def _runs(v):
    """``v`` with its last axis cut into runs of ``LANE`` consecutive elements: shape ``[..., L]`` ->
    ``[..., L // LANE, LANE]``. A run lies inside one thread's registers (the loads give each thread at
    least 8 consecutive elements), so reducing it (the new last axis) crosses no thread: no shuffle, no
    barrier."""
    if len(v.shape) == 1:
        return tl.reshape(v, [v.shape[0] // LANE, LANE])
    else:
        return tl.reshape(v, [v.shape[0], v.shape[1] // LANE, LANE])


@triton.jit
def _max_sum(a1, c1, a2, c2):
    return tl.maximum(a1, a2), c1 + c2  # maxnumf: a NaN loses to any number


@triton.jit
def _sum_sum_min(s1, e1, m1, s2, e2, m2):
    return s1 + s2, e1 + e2, tl.minimum(m1, m2)


@triton.jit
def _given_amax(amax_ptr, amax_n, HAS_AMAX: tl.constexpr, AMAX_PARTS: tl.constexpr):
    """The amax handed to the kernel, as a float32 ``|amax|`` (0 without one): one value of any float dtype,
    or (``AMAX_PARTS``) the maximum of ``amax_n`` partial maxima, the float32 bits of ``|x|`` as int32 (the
    current-scaling amax pass's, NaN already read as 0; integer order is float order for them), read 128 at a
    time. Read once, at the program's start: a value held through the main loop costs one register, where
    the pointer and count to read it again at the end cost three. (sm_90, bf16 in, with the quality
    statistics: one 1024-wide masked read of the partials instead of the 128-wide loop raised the 1-D
    kernel's registers from 80 to 94, from three programs per SM to two, both built through
    ``cross_build.sass_profile``; ``bench/sass.py`` profiles the shipped form.)"""
    if not HAS_AMAX:
        return 0.0
    elif AMAX_PARTS:
        i = tl.arange(0, 128)
        acc = tl.zeros([128], dtype=tl.int32)
        for c in range(0, amax_n, 128):
            acc = tl.maximum(acc, tl.load(amax_ptr + c + i, mask=c + i < amax_n, other=0))
        return tl.max(acc, axis=0).to(tl.float32, bitcast=True)
    else:
        return tl.abs(tl.load(amax_ptr).to(tl.float32))


@triton.jit
def _load_scale(scale_ptr, amax, FMAX: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr, POW2_SCALE: tl.constexpr):
    """The scale: given, or (current scaling) ``FP8_MAX / amax`` clamped, 1 for a zero/non-finite amax,
    optionally rounded down to a power of two (the bits masked with ``0xFF800000``); ``amax`` is
    ``_given_amax``'s."""
    if SCALE_FROM_AMAX:
        s = tl.minimum(tl.math.div_rn(FMAX + tl.zeros_like(amax), amax), 3.4028234663852886e38)
        ok = (amax > 0) & (amax.to(tl.int32, bitcast=True) < 0x7F800000)
        s = tl.where(ok, s, 1.0)
        if POW2_SCALE:
            s = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # -8388608: 0xFF800000
        return s
    else:
        return tl.load(scale_ptr).to(tl.float32)


@triton.jit
def _fmax_into(stats_ptr, a):
    """``stats[0] = fmax(stats[0], a)`` for a non-negative, non-NaN float32 ``a``, atomically (an integer max
    of the float64 bits; a NaN found in the row, put there from outside, is swapped out as ``fmax`` would).
    Returns whether ``a`` is at least the value it met: for one call's programs, all with the same scale, true
    for the one holding the call's amax exactly when that amax is at least the row's before the call."""
    slot = stats_ptr.to(tl.pointer_type(tl.int64))
    bits = a.to(tl.float64).to(tl.int64, bitcast=True)
    old = tl.atomic_max(slot, bits)
    won = bits >= old
    if old > 0x7FF0000000000000:  # a NaN, which sorts above every amax: swap it out
        prev = tl.atomic_cas(slot, old, bits)
        won = prev == old
        if prev != old:  # another program swapped it first: a max with theirs
            won = bits >= tl.atomic_max(slot, bits)
    return won


@triton.jit
def _accumulate_quality(stats_ptr, subnormal, sq, err, min_bits, scale):
    """Fold one program's quality totals into the row: the sums of squares over ``scale**2`` in float64,
    the subnormal count summed, ``min_abs`` an atomic min of the float64 bits (the row starts at +inf; a NaN
    put there from outside sorts above every value and is replaced, as ``fmin`` would)."""
    inv = 1.0 / scale.to(tl.float64)
    tl.atomic_add(stats_ptr + 6, sq.to(tl.float64) * inv * inv)
    tl.atomic_add(stats_ptr + 7, err.to(tl.float64) * inv * inv)
    tl.atomic_add(stats_ptr + 8, subnormal.to(tl.float64))
    m = min_bits.to(tl.float32, bitcast=True).to(tl.float64).to(tl.int64, bitcast=True)
    tl.atomic_min((stats_ptr + 9).to(tl.pointer_type(tl.int64)), m)


@triton.jit
def _accumulate_stats(
    stats_ptr,
    given_amax,
    scale_out_ptr,
    amax,
    overflow,
    underflow,
    nonfinite,
    scale,
    n,
    HAS_AMAX: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
):
    """Fold one program's totals into the float64 statistics row (columns ``BASE_COLUMNS``): amax fmax,
    scale the one of the call that set the amax (``quantize_with_stats_reference``), counts summed."""
    pid = tl.program_id(0)
    if HAS_AMAX:
        if pid == 0:
            a = abs_bits(given_amax)
            if _fmax_into(stats_ptr, tl.where(a > 0x7F800000, 0, a).to(tl.float32, bitcast=True)):
                tl.store(stats_ptr + 1, scale.to(tl.float64))
    elif _fmax_into(stats_ptr, amax):
        tl.store(stats_ptr + 1, scale.to(tl.float64))
    tl.atomic_add(stats_ptr + 2, overflow.to(tl.float64))
    tl.atomic_add(stats_ptr + 3, underflow.to(tl.float64))
    tl.atomic_add(stats_ptr + 4, nonfinite.to(tl.float64))
    if pid == 0:
        tl.atomic_add(stats_ptr + 5, n.to(tl.float64))
        if SCALE_FROM_AMAX:  # the scale, and 16 bytes on its reciprocal (the GEMM's scale_inv, IEEE-rounded)
            tl.store(scale_out_ptr, scale)
            tl.store(scale_out_ptr + 4, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))


@triton.jit
def _fold(x, ax, counts, qa, af, amax_acc, count_acc, sq_acc, err_acc, min_acc, QUALITY: tl.constexpr):
    """The accumulators after one block (1-D) or tile (2-D), from ``_scale_and_count``'s and ``_to_fp8``'s
    per-element values, each folded per run (``_runs``)."""
    if QUALITY:
        sq_acc, err_acc, min_acc = _quality_terms(x, qa, af, sq_acc, err_acc, min_acc)
    amax_run, count_run = tl.reduce((_runs(ax), _runs(counts)), len(x.shape), _max_sum)
    return tl.maximum(amax_acc, amax_run), count_acc + count_run, sq_acc, err_acc, min_acc


@triton.jit
def _quantize_block(
    x_ptr,
    q_ptr,
    precast_ptr,
    offs,
    mask,
    scale,
    amax_acc,
    count_acc,
    sq_acc,
    err_acc,
    min_acc,
    FMAX: tl.constexpr,
    UNDERFLOW: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr,
    OVF_INCLUSIVE: tl.constexpr,
    SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    QUALITY: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    SAT_CAST: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """One block of the 1-D kernel (``mask=None``: a full block); returns the updated accumulators.
    Masked-out elements load as 0, which counts as nothing."""
    x = load_f32(x_ptr, offs, mask, IS_BF16)
    return _quantize_values(
        x,
        q_ptr,
        precast_ptr,
        offs,
        mask,
        scale,
        amax_acc,
        count_acc,
        sq_acc,
        err_acc,
        min_acc,
        FMAX,
        UNDERFLOW,
        OVF_THRESHOLD,
        OVF_INCLUSIVE,
        SUBNORMAL_TOP,
        MIN_NORMAL,
        SUB_MAGIC,
        DROP,
        QUALITY,
        STORE_PRECAST,
        SAT_CAST,
    )


@triton.jit
def _quantize_values(
    x,
    q_ptr,
    precast_ptr,
    offs,
    mask,
    scale,
    amax_acc,
    count_acc,
    sq_acc,
    err_acc,
    min_acc,
    FMAX: tl.constexpr,
    UNDERFLOW: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr,
    OVF_INCLUSIVE: tl.constexpr,
    SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    QUALITY: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    SAT_CAST: tl.constexpr,
):
    """``_quantize_block`` on values already loaded (float32)."""
    ax, counts, xs, af = _scale_and_count(
        x, scale, FMAX, UNDERFLOW, OVF_THRESHOLD, OVF_INCLUSIVE, SUBNORMAL_TOP, QUALITY
    )
    q, _ = _to_fp8(xs, q_ptr.dtype.element_ty, FMAX, MIN_NORMAL, SUB_MAGIC, DROP, SAT_CAST)
    qa = af  # unused without QUALITY
    if QUALITY:  # |q| as float32, 0 for a non-finite x (_quality_terms)
        _, qa = _to_fp8(af, q_ptr.dtype.element_ty, FMAX, MIN_NORMAL, SUB_MAGIC, DROP, SAT_CAST)
    tl.store(q_ptr + offs, q, mask=mask)
    if STORE_PRECAST:
        tl.store(precast_ptr + offs, _clamp(xs, FMAX), mask=mask)
    return _fold(x, ax, counts, qa, af, amax_acc, count_acc, sq_acc, err_acc, min_acc, QUALITY)


@triton.jit(do_not_specialize=["n", "amax_n"])
def _quantize_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    amax_ptr,
    amax_n,
    stats_ptr,
    precast_ptr,
    scale_out_ptr,
    n,
    FMAX: tl.constexpr,
    UNDERFLOW: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr,
    OVF_INCLUSIVE: tl.constexpr,
    SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    QUALITY: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POW2_SCALE: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    SAT_CAST: tl.constexpr,
    IS_BF16: tl.constexpr,
    PREFETCH: tl.constexpr,
    STAGES: tl.constexpr,
    AMAX_PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    given_amax = _given_amax(amax_ptr, amax_n, HAS_AMAX, AMAX_PARTS)
    scale = _load_scale(scale_ptr, given_amax, FMAX, SCALE_FROM_AMAX, POW2_SCALE)
    amax_acc = tl.zeros([BLOCK // LANE], dtype=tl.float32)
    count_acc = tl.zeros([BLOCK // LANE], dtype=tl.int32)
    sq_acc = tl.zeros([BLOCK // LANE], dtype=tl.float64)
    err_acc = tl.zeros([BLOCK // LANE], dtype=tl.float64)
    min_acc = tl.full([BLOCK // LANE], 0xFFFFFFFF, dtype=tl.uint32)
    n_full = n // BLOCK
    lanes = tl.arange(0, BLOCK)
    if PREFETCH:
        # two blocks in flight per program: the loads of a program's next block are issued before it works
        # on the current one (the last iteration re-reads its own block: clamped, never out of bounds)
        first = tl.maximum(tl.minimum(pid, n_full - 1), 0) * BLOCK + lanes
        raw = tl.load(x_ptr + first, mask=first < n, other=0)
        for b in range(pid, n_full, nprog):  # full blocks: no mask
            cur = raw
            raw = tl.load(x_ptr + tl.minimum(b + nprog, n_full - 1) * BLOCK + lanes)
            amax_acc, count_acc, sq_acc, err_acc, min_acc = _quantize_values(
                to_f32(cur, IS_BF16),
                q_ptr,
                precast_ptr,
                b * BLOCK + lanes,
                None,
                scale,
                amax_acc,
                count_acc,
                sq_acc,
                err_acc,
                min_acc,
                FMAX,
                UNDERFLOW,
                OVF_THRESHOLD,
                OVF_INCLUSIVE,
                SUBNORMAL_TOP,
                MIN_NORMAL,
                SUB_MAGIC,
                DROP,
                QUALITY,
                STORE_PRECAST,
                SAT_CAST,
            )
    else:  # Triton's software pipeline (STAGES >= 2 on a GPU: copies STAGES - 1 blocks ahead)
        for b in tl.range(pid, n_full, nprog, num_stages=STAGES):  # full blocks: no mask
            amax_acc, count_acc, sq_acc, err_acc, min_acc = _quantize_block(
                x_ptr,
                q_ptr,
                precast_ptr,
                b * BLOCK + lanes,
                None,
                scale,
                amax_acc,
                count_acc,
                sq_acc,
                err_acc,
                min_acc,
                FMAX,
                UNDERFLOW,
                OVF_THRESHOLD,
                OVF_INCLUSIVE,
                SUBNORMAL_TOP,
                MIN_NORMAL,
                SUB_MAGIC,
                DROP,
                QUALITY,
                STORE_PRECAST,
                SAT_CAST,
                IS_BF16,
            )
    tail = n_full * BLOCK
    if (pid == n_full % nprog) & (tail < n):  # the partial block, by the program whose turn comes next
        offs = tail + tl.arange(0, BLOCK)
        amax_acc, count_acc, sq_acc, err_acc, min_acc = _quantize_block(
            x_ptr,
            q_ptr,
            precast_ptr,
            offs,
            offs < n,
            scale,
            amax_acc,
            count_acc,
            sq_acc,
            err_acc,
            min_acc,
            FMAX,
            UNDERFLOW,
            OVF_THRESHOLD,
            OVF_INCLUSIVE,
            SUBNORMAL_TOP,
            MIN_NORMAL,
            SUB_MAGIC,
            DROP,
            QUALITY,
            STORE_PRECAST,
            SAT_CAST,
            IS_BF16,
        )
    # unpack before summing: each field of a slot is at most LANE * MAX_BLOCKS_PER_PROGRAM (< 2**8)
    _accumulate_stats(
        stats_ptr,
        given_amax,
        scale_out_ptr,
        tl.max(amax_acc, axis=0),
        tl.sum(count_acc & 255, axis=0),
        tl.sum((count_acc >> 8) & 255, axis=0),
        tl.sum((count_acc >> 16) & 255, axis=0),
        scale,
        n,
        HAS_AMAX,
        SCALE_FROM_AMAX,
    )
    if QUALITY:
        sq, err, low = tl.sum(sq_acc, axis=0), tl.sum(err_acc, axis=0), tl.min(min_acc, axis=0)
        if _needs_exact(sq, err, low):
            sq, err = _exact_sums_1d(
                x_ptr, q_ptr, n, scale, FMAX, MIN_NORMAL, SUB_MAGIC, DROP, SAT_CAST, IS_BF16, BLOCK
            )
        _accumulate_quality(
            stats_ptr, tl.sum((count_acc >> 24) & 255, axis=0), sq, err, _min_abs_bits(low), scale
        )


@triton.jit
def _pair_offsets(tm, tn, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile ``(tm, tn)`` as two halves, its even rows and its odd rows, each ``[BLOCK_M // 2, BLOCK_N]``:
    ``(offsets of the even rows in x / q, even-row indices, column indices)``; the odd rows are ``+ N``."""
    re = tm * BLOCK_M + 2 * tl.arange(0, BLOCK_M // 2)
    rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    return re[:, None] * N + rn[None, :], re, rn


@triton.jit
def _store_transposed(
    qt_ptr,
    qe,
    qo,
    tm,
    re,
    rn,
    M,
    N,
    MASKED: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The tile's two FP8 halves into ``qt`` (``(N, M)``). ``PACKED`` (``M`` a multiple of 16): each
    column's rows ``2i`` and ``2i + 1`` as one 16-bit word, so the transpose moves 16-bit words (Triton reads
    them back from shared memory with ``ldmatrix.trans``, 16 bytes per thread, where single bytes took 16
    loads) and ``qt`` is written as 16-bit words. Otherwise (rows of ``qt`` not 2-byte aligned) the halves
    are interleaved back into the tile and transposed byte by byte."""
    if PACKED:
        pair = qe.to(tl.uint8, bitcast=True).to(tl.uint16) | (
            qo.to(tl.uint8, bitcast=True).to(tl.uint16) << 8
        )
        half = tm * (BLOCK_M // 2) + tl.arange(0, BLOCK_M // 2)
        offs_t = rn[:, None] * (M // 2) + half[None, :]
        mask_t = (rn[:, None] < N) & (half[None, :] < M // 2) if MASKED else None
        tl.store(qt_ptr.to(tl.pointer_type(tl.uint16)) + offs_t, tl.trans(pair), mask=mask_t)
    else:
        both = tl.join(qe.to(tl.uint8, bitcast=True), qo.to(tl.uint8, bitcast=True))  # [BM // 2, BN, 2]
        tile = tl.reshape(tl.permute(both, (0, 2, 1)), [BLOCK_M, BLOCK_N])  # rows 2i + j
        rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_t = rn[:, None] * M + rm[None, :]
        mask_t = (rn[:, None] < N) & (rm[None, :] < M) if MASKED else None
        tl.store(qt_ptr.to(tl.pointer_type(tl.uint8)) + offs_t, tl.trans(tile), mask=mask_t)


@triton.jit
def _quantize_half(
    x,
    q_ptr,
    precast_ptr,
    offs,
    mask,
    scale,
    amax_acc,
    count_acc,
    sq_acc,
    err_acc,
    min_acc,
    FMAX: tl.constexpr,
    UNDERFLOW: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr,
    OVF_INCLUSIVE: tl.constexpr,
    SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    QUALITY: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    SAT_CAST: tl.constexpr,
):
    """One half of a tile (values already loaded, float32): its FP8 values written to ``q``; returns ``(q,
    accumulators)``."""
    ax, counts, xs, af = _scale_and_count(
        x, scale, FMAX, UNDERFLOW, OVF_THRESHOLD, OVF_INCLUSIVE, SUBNORMAL_TOP, QUALITY
    )
    q, _ = _to_fp8(xs, q_ptr.dtype.element_ty, FMAX, MIN_NORMAL, SUB_MAGIC, DROP, SAT_CAST)
    qa = af  # unused without QUALITY
    if QUALITY:  # |q| as float32, 0 for a non-finite x (_quality_terms)
        _, qa = _to_fp8(af, q_ptr.dtype.element_ty, FMAX, MIN_NORMAL, SUB_MAGIC, DROP, SAT_CAST)
    tl.store(q_ptr + offs, q, mask=mask)
    if STORE_PRECAST:
        tl.store(precast_ptr + offs, _clamp(xs, FMAX), mask=mask)
    amax_acc, count_acc, sq_acc, err_acc, min_acc = _fold(
        x, ax, counts, qa, af, amax_acc, count_acc, sq_acc, err_acc, min_acc, QUALITY
    )
    return q, amax_acc, count_acc, sq_acc, err_acc, min_acc


@triton.jit
def _quantize_pair_tile(
    xe,
    xo,
    q_ptr,
    qt_ptr,
    precast_ptr,
    tm,
    tn,
    M,
    N,
    scale,
    amax_acc,
    count_acc,
    sq_acc,
    err_acc,
    min_acc,
    col_acc,
    MASKED: tl.constexpr,
    FMAX: tl.constexpr,
    UNDERFLOW: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr,
    OVF_INCLUSIVE: tl.constexpr,
    SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    QUALITY: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    SAT_CAST: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    DBIAS: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Tile ``(tm, tn)`` of the 2-D kernel from its two halves (even rows ``xe``, odd rows ``xo``, float32,
    masked-out elements 0): written to ``q``, with ``TRANSPOSE`` to ``qt``, with ``DBIAS`` added into the
    column sums ``col_acc`` (element by element: nothing crosses threads per tile). Returns the updated
    accumulators."""
    offs, re, rn = _pair_offsets(tm, tn, M, N, BLOCK_M, BLOCK_N)
    if MASKED:
        mask_e = (re[:, None] < M) & (rn[None, :] < N)
        mask_o = ((re + 1)[:, None] < M) & (rn[None, :] < N)
    else:
        mask_e = None
        mask_o = None
    qe, amax_acc, count_acc, sq_acc, err_acc, min_acc = _quantize_half(
        xe,
        q_ptr,
        precast_ptr,
        offs,
        mask_e,
        scale,
        amax_acc,
        count_acc,
        sq_acc,
        err_acc,
        min_acc,
        FMAX,
        UNDERFLOW,
        OVF_THRESHOLD,
        OVF_INCLUSIVE,
        SUBNORMAL_TOP,
        MIN_NORMAL,
        SUB_MAGIC,
        DROP,
        QUALITY,
        STORE_PRECAST,
        SAT_CAST,
    )
    qo, amax_acc, count_acc, sq_acc, err_acc, min_acc = _quantize_half(
        xo,
        q_ptr,
        precast_ptr,
        offs + N,
        mask_o,
        scale,
        amax_acc,
        count_acc,
        sq_acc,
        err_acc,
        min_acc,
        FMAX,
        UNDERFLOW,
        OVF_THRESHOLD,
        OVF_INCLUSIVE,
        SUBNORMAL_TOP,
        MIN_NORMAL,
        SUB_MAGIC,
        DROP,
        QUALITY,
        STORE_PRECAST,
        SAT_CAST,
    )
    if TRANSPOSE:
        _store_transposed(qt_ptr, qe, qo, tm, re, rn, M, N, MASKED, PACKED, BLOCK_M, BLOCK_N)
    if DBIAS:
        col_acc += xe + xo
    return amax_acc, count_acc, sq_acc, err_acc, min_acc, col_acc


@triton.jit
def _load_pair(x_ptr, tm, tn, M, N, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The raw (as stored) halves of tile ``(tm, tn)``; masked-out elements 0."""
    offs, re, rn = _pair_offsets(tm, tn, M, N, BLOCK_M, BLOCK_N)
    if MASKED:
        raw_e = tl.load(x_ptr + offs, mask=(re[:, None] < M) & (rn[None, :] < N), other=0)
        raw_o = tl.load(x_ptr + offs + N, mask=((re + 1)[:, None] < M) & (rn[None, :] < N), other=0)
    else:
        raw_e = tl.load(x_ptr + offs)
        raw_o = tl.load(x_ptr + offs + N)
    return raw_e, raw_o


@triton.jit
def _to_x_dtype(v, dst_ptr, IS_BF16: tl.constexpr):
    """Float32 ``v`` in the element type of ``dst_ptr`` (bfloat16 as its int16 bits, rounded to nearest
    even on the bits, NaN kept quiet: the same on every backend, as ``load_f32`` widens it)."""
    if IS_BF16:
        b = v.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, (b >> 16) | 0x40, r)
        return r.to(tl.int16)
    else:
        return v.to(dst_ptr.dtype.element_ty)


@triton.jit
def _flush_column_sums(
    col_acc, ws_ptr, cnt_ptr, dbias_ptr, tn, pm, PM, N, W, IS_BF16: tl.constexpr, BLOCK_N: tl.constexpr
):
    """This program's column sums of tile column ``tn`` (its row tiles ``pm, pm + PM, ...``) into row ``pm``
    of the float32 workspace ``ws`` (``(PM, W)``); the last of the column's ``PM`` programs to arrive (the
    counter ``cnt[tn]``, which it sets back to 0 for the next call) adds the ``PM`` rows in order 0, 1, ...
    and writes ``dbias``: the same sums in the same order whichever program comes last, so the result is
    deterministic. The barrier orders every thread's workspace stores before the counter's release; the
    counter's acquire orders the last program's reads after them (read at L2, ``.cg``)."""
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(ws_ptr + pm * W + cols, tl.sum(col_acc, axis=0))
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tn, 1, sem="acq_rel", scope="gpu")
    if arrived == PM - 1:
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for p in range(0, PM):
            total += tl.load(ws_ptr + p * W + cols, cache_modifier=".cg")
        tl.store(dbias_ptr + cols, _to_x_dtype(total, dbias_ptr, IS_BF16), mask=cols < N)
        tl.store(cnt_ptr + tn, 0)


@triton.jit
def _exact_sums_2d(
    x_ptr,
    q_ptr,
    M,
    N,
    pm,
    pn,
    PM,
    PN,
    scale,
    FMAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    SAT_CAST: tl.constexpr,
    IS_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``_exact_sums_1d`` for the 2-D kernel: this program's tiles (tile columns ``pn, pn + PN, ...``, tile
    rows ``pm, pm + PM, ...``), every one masked, an eighth of its rows at a time."""
    ROWS: tl.constexpr = BLOCK_M // 8
    sq = tl.zeros([ROWS, BLOCK_N], dtype=tl.float64)
    err = tl.zeros([ROWS, BLOCK_N], dtype=tl.float64)
    for tn in range(pn, tl.cdiv(N, BLOCK_N), PN):
        rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        for tm in range(pm, tl.cdiv(M, BLOCK_M), PM):
            for r in range(0, BLOCK_M, ROWS):
                rm = tm * BLOCK_M + r + tl.arange(0, ROWS)
                mask = (rm[:, None] < M) & (rn[None, :] < N)
                x = load_f32(x_ptr, rm[:, None] * N + rn[None, :], mask, IS_BF16)
                dtype = q_ptr.dtype.element_ty
                s, d = _exact_terms(x, scale, dtype, FMAX, MIN_NORMAL, SUB_MAGIC, DROP, SAT_CAST)
                sq += s
                err += d
    return tl.sum(tl.sum(sq, axis=1), axis=0), tl.sum(tl.sum(err, axis=1), axis=0)


@triton.jit(do_not_specialize=["M", "N", "amax_n", "PN"])
def _quantize_t_kernel(
    x_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    amax_ptr,
    amax_n,
    stats_ptr,
    precast_ptr,
    scale_out_ptr,
    ws_ptr,
    cnt_ptr,
    dbias_ptr,
    M,
    N,
    PN,
    FMAX: tl.constexpr,
    UNDERFLOW: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr,
    OVF_INCLUSIVE: tl.constexpr,
    SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    DROP: tl.constexpr,
    QUALITY: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POW2_SCALE: tl.constexpr,
    STORE_PRECAST: tl.constexpr,
    SAT_CAST: tl.constexpr,
    IS_BF16: tl.constexpr,
    DIV_M: tl.constexpr,
    DIV_N: tl.constexpr,
    PREFETCH: tl.constexpr,
    STAGES: tl.constexpr,
    AMAX_PARTS: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    DBIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    # the programs form a PM x PN grid: program (pm, pn) takes tile columns pn, pn + PN, ... and in each the
    # tile rows pm, pm + PM, ...: the PN programs of one pm read one band of rows together, and each
    # program's tiles of one column follow one another, so that its column sums stay in its registers
    PM = tl.num_programs(0) // PN
    pm = pid // PN
    pn = pid - pm * PN
    # exact (the launcher passes a divisor of each): the compiler then knows rows start 16-aligned
    M = (M // DIV_M) * DIV_M
    N = (N // DIV_N) * DIV_N
    PACKED: tl.constexpr = DIV_M == 16
    given_amax = _given_amax(amax_ptr, amax_n, HAS_AMAX, AMAX_PARTS)
    scale = _load_scale(scale_ptr, given_amax, FMAX, SCALE_FROM_AMAX, POW2_SCALE)
    HALF: tl.constexpr = BLOCK_M // 2
    amax_acc = tl.zeros([HALF, BLOCK_N // LANE], dtype=tl.float32)
    count_acc = tl.zeros([HALF, BLOCK_N // LANE], dtype=tl.int32)
    sq_acc = tl.zeros([HALF, BLOCK_N // LANE], dtype=tl.float64)
    err_acc = tl.zeros([HALF, BLOCK_N // LANE], dtype=tl.float64)
    min_acc = tl.full([HALF, BLOCK_N // LANE], 0xFFFFFFFF, dtype=tl.uint32)
    full_m = M // BLOCK_M
    full_n = N // BLOCK_N
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tn in range(pn, tiles_n, PN):
        col_acc = tl.zeros([HALF, BLOCK_N], dtype=tl.float32)
        masked_from = 0
        if tn < full_n:  # a column of full tiles down to the last full tile row: no mask
            if PREFETCH:
                # two tiles in flight per program, as in the 1-D kernel (the last iteration re-reads its own
                # tile); a program with no full tile here masks the prologue's load off entirely
                first = tl.maximum(tl.minimum(pm, full_m - 1), 0)
                offs, _, _ = _pair_offsets(first, tn, M, N, BLOCK_M, BLOCK_N)
                valid = tl.where(pm < full_m, M * N, 0)
                raw_e = tl.load(x_ptr + offs, mask=offs < valid, other=0)
                raw_o = tl.load(x_ptr + offs + N, mask=offs + N < valid, other=0)
                for tm in range(pm, full_m, PM):
                    nxt = tm + PM
                    nxt = tl.where(nxt < full_m, nxt, tm)
                    cur_e = raw_e
                    cur_o = raw_o
                    raw_e, raw_o = _load_pair(x_ptr, nxt, tn, M, N, False, BLOCK_M, BLOCK_N)
                    amax_acc, count_acc, sq_acc, err_acc, min_acc, col_acc = _quantize_pair_tile(
                        to_f32(cur_e, IS_BF16),
                        to_f32(cur_o, IS_BF16),
                        q_ptr,
                        qt_ptr,
                        precast_ptr,
                        tm,
                        tn,
                        M,
                        N,
                        scale,
                        amax_acc,
                        count_acc,
                        sq_acc,
                        err_acc,
                        min_acc,
                        col_acc,
                        False,
                        FMAX,
                        UNDERFLOW,
                        OVF_THRESHOLD,
                        OVF_INCLUSIVE,
                        SUBNORMAL_TOP,
                        MIN_NORMAL,
                        SUB_MAGIC,
                        DROP,
                        QUALITY,
                        STORE_PRECAST,
                        SAT_CAST,
                        TRANSPOSE,
                        DBIAS,
                        PACKED,
                        BLOCK_M,
                        BLOCK_N,
                    )
            else:  # Triton's software pipeline, as in the 1-D kernel
                for tm in tl.range(pm, full_m, PM, num_stages=STAGES):
                    raw_e, raw_o = _load_pair(x_ptr, tm, tn, M, N, False, BLOCK_M, BLOCK_N)
                    amax_acc, count_acc, sq_acc, err_acc, min_acc, col_acc = _quantize_pair_tile(
                        to_f32(raw_e, IS_BF16),
                        to_f32(raw_o, IS_BF16),
                        q_ptr,
                        qt_ptr,
                        precast_ptr,
                        tm,
                        tn,
                        M,
                        N,
                        scale,
                        amax_acc,
                        count_acc,
                        sq_acc,
                        err_acc,
                        min_acc,
                        col_acc,
                        False,
                        FMAX,
                        UNDERFLOW,
                        OVF_THRESHOLD,
                        OVF_INCLUSIVE,
                        SUBNORMAL_TOP,
                        MIN_NORMAL,
                        SUB_MAGIC,
                        DROP,
                        QUALITY,
                        STORE_PRECAST,
                        SAT_CAST,
                        TRANSPOSE,
                        DBIAS,
                        PACKED,
                        BLOCK_M,
                        BLOCK_N,
                    )
            masked_from = full_m
        # the edge tiles of this column, masked: the last tile row, or every row of the last tile column
        for tm in range(masked_from + (pm + PM - masked_from % PM) % PM, tiles_m, PM):
            raw_e, raw_o = _load_pair(x_ptr, tm, tn, M, N, True, BLOCK_M, BLOCK_N)
            amax_acc, count_acc, sq_acc, err_acc, min_acc, col_acc = _quantize_pair_tile(
                to_f32(raw_e, IS_BF16),
                to_f32(raw_o, IS_BF16),
                q_ptr,
                qt_ptr,
                precast_ptr,
                tm,
                tn,
                M,
                N,
                scale,
                amax_acc,
                count_acc,
                sq_acc,
                err_acc,
                min_acc,
                col_acc,
                True,
                FMAX,
                UNDERFLOW,
                OVF_THRESHOLD,
                OVF_INCLUSIVE,
                SUBNORMAL_TOP,
                MIN_NORMAL,
                SUB_MAGIC,
                DROP,
                QUALITY,
                STORE_PRECAST,
                SAT_CAST,
                TRANSPOSE,
                DBIAS,
                PACKED,
                BLOCK_M,
                BLOCK_N,
            )
        if DBIAS:
            _flush_column_sums(
                col_acc, ws_ptr, cnt_ptr, dbias_ptr, tn, pm, PM, N, tiles_n * BLOCK_N, IS_BF16, BLOCK_N
            )
    # unpack before summing: each field of a slot is at most LANE * MAX_BLOCKS_PER_PROGRAM (< 2**8)
    amax = tl.max(tl.max(amax_acc, axis=1), axis=0)
    overflow = tl.sum(tl.sum(count_acc & 255, axis=1), axis=0)
    underflow = tl.sum(tl.sum((count_acc >> 8) & 255, axis=1), axis=0)
    nonfinite = tl.sum(tl.sum((count_acc >> 16) & 255, axis=1), axis=0)
    _accumulate_stats(
        stats_ptr,
        given_amax,
        scale_out_ptr,
        amax,
        overflow,
        underflow,
        nonfinite,
        scale,
        M * N,
        HAS_AMAX,
        SCALE_FROM_AMAX,
    )
    if QUALITY:
        sq = tl.sum(tl.sum(sq_acc, axis=1), axis=0)
        err = tl.sum(tl.sum(err_acc, axis=1), axis=0)
        low = tl.min(tl.min(min_acc, axis=1), axis=0)
        if _needs_exact(sq, err, low):
            sq, err = _exact_sums_2d(
                x_ptr,
                q_ptr,
                M,
                N,
                pm,
                pn,
                PM,
                PN,
                scale,
                FMAX,
                MIN_NORMAL,
                SUB_MAGIC,
                DROP,
                SAT_CAST,
                IS_BF16,
                BLOCK_M,
                BLOCK_N,
            )
        _accumulate_quality(
            stats_ptr,
            tl.sum(tl.sum((count_acc >> 24) & 255, axis=1), axis=0),
            sq,
            err,
            _min_abs_bits(low),
            scale,
        )


def _check(x, scale, stats, precast, amax) -> torch.Tensor:
    """Validate the operands (host metadata only, nothing read from the device); return the stats row."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"x: expected a float32/bfloat16/float16/float64 tensor, got {x.dtype}")
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"x: {x.numel()} elements exceed the Triton kernel's limit of {MAX_NUMEL}")
    for name, t in (("scale", scale), ("amax", amax), ("stats", stats), ("precast", precast)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, expected x's device {x.device}")
    if stats is None:
        return new_stats(device=x.device)
    widths = (len(STAT_COLUMNS), len(BASE_COLUMNS))
    if (
        stats.dtype != torch.float64
        or stats.dim() != 1
        or stats.shape[0] not in widths
        or not stats.is_contiguous()
    ):
        raise ValueError(
            f"stats: expected a contiguous float64 ({widths[0]},) or ({widths[1]},) row, "
            f"got {stats.dtype} {tuple(stats.shape)}"
        )
    return stats


def _check_amax_parts(parts: torch.Tensor | None, amax: torch.Tensor | None, device: torch.device) -> None:
    if parts is None:
        return
    if amax is not None:
        raise ValueError("amax_parts: give amax or amax_parts, not both")
    if (
        parts.dtype != torch.int32
        or parts.dim() != 1
        or not parts.is_contiguous()
        or parts.numel() < 1
        or parts.numel() >= 2**31
        or parts.device != device
    ):
        raise ValueError(
            f"amax_parts: expected a contiguous, non-empty 1-D int32 tensor of partial maxima on {device}, "
            f"got {parts.dtype} {tuple(parts.shape)} on {parts.device}"
        )


def _check_precast(precast: torch.Tensor | None, x: torch.Tensor) -> None:
    if precast is not None and (
        precast.dtype != torch.float32 or precast.shape != x.shape or not precast.is_contiguous()
    ):
        raise ValueError(f"precast: expected a contiguous float32 tensor of shape {tuple(x.shape)}")


def launch_quantize(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None,
    *,
    amax: torch.Tensor | None = None,
    amax_parts: torch.Tensor | None = None,
    scale_from_amax: bool = False,
    precast: torch.Tensor | None = None,
    transpose: bool = False,
    power_2_scale: bool = False,
    scale_out: torch.Tensor | None = None,
    dbias: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Run the fused kernel; ``(q, qt or None, stats_row, scale used as a float32 0-dim tensor)``, and with
    ``dbias`` the column sums last.

    Args:
        amax: ``x``'s amax, a 0-dim float tensor, recorded in the statistics row instead of the kernel's own.
        amax_parts: instead of ``amax``, partial maxima whose maximum is the amax: a contiguous 1-D int32
            tensor of float32 bit patterns of ``|x|`` (NaN read as 0), as the current-scaling amax pass writes
            them (``triton.current``).
        scale_from_amax: current scaling in-kernel: the scale is ``FP8_MAX / amax`` clamped to the float32
            maximum, 1 for a zero or non-finite ``amax`` (``amax`` or ``amax_parts`` required, ``scale``
            ignored).
        power_2_scale: with ``scale_from_amax``, round that scale down to a power of two.
        scale_out: with ``scale_from_amax``, a float32 buffer of at least 5 elements, its start 16-byte
            aligned: the kernel writes the scale to element 0 and its reciprocal (``torch.reciprocal``'s
            bits) to element 4, where each is a 16-byte-aligned 0-dim view (the GEMM's ``scale_inv``); a fresh
            one when not given. The scale returned is the view of element 0.
        precast: optional contiguous float32 tensor of ``x``'s shape that receives the clamped ``x * scale``
            values before the FP8 cast (for exact comparisons where the cast itself cannot be trusted).
        transpose: also write ``q.t().contiguous()`` in the same pass (2-D ``x`` only).
        dbias: also return ``x.sum(0)`` of a 2-D ``x`` (float32 sums, in ``x``'s dtype), taken by the same
            pass (the tiled kernel, with or without the transposed output): see ``_flush_column_sums``.
    """
    if dbias:
        check_dbias_operand(x)
    row = _check(x, scale, stats, precast, amax)
    _check_precast(precast, x)
    _check_amax_parts(amax_parts, amax, x.device)
    if transpose and x.dim() != 2:
        raise ValueError(f"x: the transposed output needs a 2-D tensor, got shape {tuple(x.shape)}")
    if power_2_scale and not scale_from_amax:
        raise ValueError("power_2_scale: applies to current scaling (scale_from_amax) only")
    format_constants(fp8_dtype)  # refuses anything but the two FP8 dtypes, before allocating (cached)
    device = x.device
    given = amax if amax is not None else amax_parts
    scale_t = _scale_operand(scale, given, scale_from_amax, scale_out)
    xc, is_bf16 = as_kernel_input(x)
    q = torch.empty(x.shape, dtype=fp8_dtype, device=device)
    amax_arg = given if given is not None else scale_t
    amax_n = amax_parts.numel() if amax_parts is not None else 1
    precast_arg = precast if precast is not None else q
    shape = (  # the kernel's choices: whatever in this call selects its constexprs and launch options
        device,
        is_bf16,
        fp8_dtype,
        row.shape[0] == len(STAT_COLUMNS),
        given is not None,
        scale_from_amax,
        power_2_scale,
        precast is not None,
        amax_parts is not None,
    )
    if not (transpose or dbias):
        n = xc.numel()
        block, kwargs = _plan(shape, None)
        grid = persistent_grid(cdiv(n, block), device)
        args = (xc, q, scale_t, amax_arg, amax_n, row, precast_arg, scale_t, n)
        launch(_quantize_kernel, grid, *args, **kwargs)
        return q, None, row, scale_t
    m, n = xc.shape
    qt = torch.empty((n, m), dtype=fp8_dtype, device=device) if transpose else None
    (bm, bn), kwargs = _plan(shape, (divisor(m), divisor(n)), transpose, dbias)
    tiles_m, tiles_n = cdiv(m, bm), cdiv(n, bn)
    pm, pn = grid_2d(tiles_m, tiles_n, device)
    if dbias:
        column_sums = torch.empty(n, dtype=x.dtype, device=device)
        extra = (*_column_buffers(device, tiles_n, pm * tiles_n * bn), as_kernel_input(column_sums)[0])
    else:
        extra = (q, q, q)  # not read
    args = (
        xc,
        q,
        q if qt is None else qt,
        scale_t,
        amax_arg,
        amax_n,
        row,
        precast_arg,
        scale_t,
        *extra,
        m,
        n,
        pn,
    )
    launch(_quantize_t_kernel, pm * pn, *args, **kwargs)
    return (q, qt, row, scale_t, column_sums) if dbias else (q, qt, row, scale_t)


class PreparedQuantize:
    """``launch_quantize`` for one call shape (``prepare_quantize``): the operands' checks, the kernel's
    constexprs, grid and launch options are settled once, so a call allocates its outputs and launches.
    ``__call__(x, scale, row) -> (q, qt or None, scale_inv or None, column sums or None)``: ``x`` of the
    prepared shape, dtype and device (contiguous or not); ``scale`` the delayed-scaling scale, a float32
    0-dim tensor on that device (ignored with current scaling, whose ``scale_inv`` the call returns, written
    by the quantize pass); ``row`` a statistics row of the prepared width."""

    __slots__ = (
        "_quantize",
        "_amax",
        "_amax_grid",
        "_dtype",
        "_shape",
        "_t_shape",
        "_bf16",
        "_numel",
        "_flat",
        "_m",
        "_n",
        "_pn",
        "_tiles_n",
        "_ws_numel",
        "_dbias",
        "_x_dtype",
    )

    def __call__(self, x: torch.Tensor, scale: torch.Tensor | None, row: torch.Tensor) -> tuple:
        # host time per call matters (bench/host_path.py): outputs are made with ``new_empty`` (x's device
        # without a device argument to parse), and no view is made that the kernels do not need
        xc = x.contiguous()
        if self._bf16:
            xc = xc.view(torch.int16)
        q = xc.new_empty(self._shape, dtype=self._dtype)
        if self._amax is None:
            scale_t, amax_arg, amax_n, scale_inv = scale, scale, 1, None
        else:  # current scaling: the amax pass, as triton.current.amax_pass
            buf = xc.new_empty(8 + self._amax_grid, dtype=torch.float32)
            amax_arg = buf[8:].view(torch.int32)
            self._amax(xc, amax_arg, self._numel)
            # the quantize pass takes the scale's buffer by its address (element 0, buf itself) and writes
            # the scale there and its reciprocal at element 4, which the GEMM takes as a 0-dim view
            scale_t, amax_n, scale_inv = buf, self._amax_grid, buf[4]
        if self._flat:
            self._quantize(xc, q, scale_t, amax_arg, amax_n, row, q, scale_t, self._numel)
            return q, None, scale_inv, None
        qt = None if self._t_shape is None else xc.new_empty(self._t_shape, dtype=self._dtype)
        column_sums = None
        if self._dbias:
            column_sums = x.new_empty(self._n)  # x's dtype
            sums = column_sums.view(torch.int16) if self._bf16 else column_sums
            extra = (*_column_buffers(xc.device, self._tiles_n, self._ws_numel), sums)
        else:
            extra = (q, q, q)  # not read
        qt_arg = q if qt is None else qt
        self._quantize(
            xc, q, qt_arg, scale_t, amax_arg, amax_n, row, q, scale_t, *extra, self._m, self._n, self._pn
        )
        return q, qt, scale_inv, column_sums


def prepare_quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    row: torch.Tensor,
    scale: torch.Tensor | None,
    *,
    transpose: bool = False,
    dbias: bool = False,
    amax: tuple | None = None,
    power_2_scale: bool = False,
) -> PreparedQuantize:
    """A ``PreparedQuantize`` for tensors like ``x`` quantized to ``fp8_dtype`` into statistics rows like
    ``row``, with scales like ``scale`` (delayed scaling) or, given ``amax`` (``(amax kernel launch,
    programs)`` from ``triton.current``), with the scale derived in the kernel from the amax pass (current
    scaling, ``power_2_scale`` as ``launch_quantize``'s). The checks of ``launch_quantize`` run here, once;
    ValueError as they raise it."""
    if row is None:
        raise ValueError("row: a prepared call records statistics; give the row it writes")
    if dbias:
        check_dbias_operand(x)
    _check(x, scale, row, None, None)
    if transpose and x.dim() != 2:
        raise ValueError(f"x: the transposed output needs a 2-D tensor, got shape {tuple(x.shape)}")
    if power_2_scale and amax is None:
        raise ValueError("power_2_scale: applies to current scaling (amax) only")
    if amax is None and (scale is None or scale.dtype != torch.float32 or scale.dim() != 0):
        raise ValueError("scale: expected a float32 0-dim tensor")
    format_constants(fp8_dtype)
    device = x.device
    p = PreparedQuantize()
    p._amax, p._amax_grid = amax if amax is not None else (None, 0)
    p._dtype, p._shape, p._x_dtype, p._dbias = fp8_dtype, tuple(x.shape), x.dtype, dbias
    p._bf16 = x.dtype == torch.bfloat16
    p._numel = x.numel()
    p._flat = not (transpose or dbias)
    shape = (
        device,
        p._bf16,
        fp8_dtype,
        row.shape[0] == len(STAT_COLUMNS),
        amax is not None,
        amax is not None,
        power_2_scale,
        False,
        amax is not None,
    )  # (launch_quantize's call shape)
    if p._flat:
        block, kwargs = _plan(shape, None)
        p._quantize = PreparedLaunch(_quantize_kernel, persistent_grid(cdiv(p._numel, block), device), kwargs)
        p._t_shape = None
        return p
    m, n = x.shape
    (bm, bn), kwargs = _plan(shape, (divisor(m), divisor(n)), transpose, dbias)
    tiles_m, p._tiles_n = cdiv(m, bm), cdiv(n, bn)
    pm, p._pn = grid_2d(tiles_m, p._tiles_n, device)
    p._m, p._n = m, n
    p._t_shape = (n, m) if transpose else None
    p._ws_numel = pm * p._tiles_n * bn
    p._quantize = PreparedLaunch(_quantize_t_kernel, pm * p._pn, kwargs)
    return p


#: ``(device, stream)`` -> ``(workspace, counters)``, what the tiled kernel's column sums work in
#: (``_flush_column_sums``): the float32 workspace of the programs' partial sums, written and read within
#: one launch, and the int32 per-column arrival counters, zero between launches (the last program to arrive
#: sets its column's back to 0). Launches on one stream run one after the other, so they share the buffers
#: (no allocation per call); another stream gets its own. The counters are zeroed once, when made or grown.
_COLUMN_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _column_buffers(device: torch.device, n: int, ws_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(workspace of at least ws_numel floats, counters for n tile columns)`` for a launch on ``device``'s
    current stream (``_COLUMN_BUFFERS``)."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream)
    held = _COLUMN_BUFFERS.get(key)
    if held is not None and held[0].numel() >= ws_numel and held[1].numel() >= n:
        return held
    ws, counters = held if held is not None else (None, None)
    if ws is None or ws.numel() < ws_numel:
        ws = torch.empty(max(ws_numel, 1 << 14), dtype=torch.float32, device=device)
    if counters is None or counters.numel() < n:
        counters = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    held = _COLUMN_BUFFERS[key] = (ws, counters)
    return held


#: ``(call shape, 2-D divisors, the launch-configuration functions)`` -> ``(block or tile, launch keywords)``
_PLANS: dict[tuple, tuple] = {}


def _plan(
    shape: tuple, divisors: tuple[int, int] | None, transpose: bool = True, dbias: bool = False
) -> tuple:
    """The constexprs and launch options of a quantize launch, built once per call shape instead of per call
    (about a third of the launcher's host time, ``bench/launch_host.py``): ``(BLOCK, kwargs)`` for the 1-D
    kernel (``divisors`` None), ``((BLOCK_M, BLOCK_N), kwargs)`` for the 2-D one. The functions that choose
    sizes and forms are part of the key, so a test (or ``cross_build.recorded``) that replaces one gets plans
    of its own."""
    config = (block_1d, tile_2d, prefetch, pipeline_stages, saturating_cast)
    key = (shape, divisors, transpose, dbias, config)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    device, is_bf16, fp8_dtype, quality, has_amax, from_amax, pow2, store_precast, parts = shape
    kwargs = dict(
        **format_constants(fp8_dtype),
        QUALITY=quality,
        HAS_AMAX=has_amax,
        SCALE_FROM_AMAX=from_amax,
        POW2_SCALE=pow2,
        STORE_PRECAST=store_precast,
        IS_BF16=is_bf16,
        PREFETCH=prefetch(device),
        STAGES=pipeline_stages(device),
        SAT_CAST=saturating_cast(device),
        AMAX_PARTS=parts,
    )
    if divisors is None:
        block, kwargs["num_warps"] = block_1d(device)
        plan = (block, kwargs | dict(BLOCK=block))
    else:
        bm, bn, kwargs["num_warps"] = tile_2d(device)
        tiled = dict(
            DIV_M=divisors[0], DIV_N=divisors[1], TRANSPOSE=transpose, DBIAS=dbias, BLOCK_M=bm, BLOCK_N=bn
        )
        plan = ((bm, bn), kwargs | tiled)
    _PLANS[key] = plan
    return plan


def quantize_with_stats_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Triton twin of ``quantize_with_stats_reference`` (same arguments, same ``(q, stats_row)``, and
    ``(q, stats_row, dbias)`` with ``dbias``: the tiled kernel without the transposed output)."""
    q, _, row, _, *column_sums = launch_quantize(x, scale, fp8_dtype, stats, amax=amax, dbias=dbias)
    return (q, row, *column_sums)


def quantize_with_stats_transposed_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """As ``quantize_with_stats_triton`` for a 2-D ``x``, also returning ``q.t().contiguous()`` written by
    the same pass: ``(q, qt, stats_row)``, ``(q, qt, stats_row, dbias)`` with ``dbias``."""
    q, qt, row, _, *column_sums = launch_quantize(
        x, scale, fp8_dtype, stats, amax=amax, transpose=True, dbias=dbias
    )
    return (q, qt, row, *column_sums)


def _prepare_delayed(transpose: bool):
    def prepare(x, fp8_dtype, row, scale, *, dbias: bool = False, power_2_scale: bool = False):
        if power_2_scale:
            raise ValueError("power_2_scale: applies to current scaling only")
        return prepare_quantize(x, fp8_dtype, row, scale, transpose=transpose, dbias=dbias)

    return prepare


# the dispatch table's prepared calls (fp8_kernels.dispatch.prepare_quantize)
quantize_with_stats_triton.prepare = _prepare_delayed(False)
quantize_with_stats_transposed_triton.prepare = _prepare_delayed(True)


def _scale_operand(scale, amax, scale_from_amax: bool, scale_out: torch.Tensor | None = None) -> torch.Tensor:
    """The scale the kernel reads, or (current scaling) the 0-dim view of element 0 of the buffer it writes
    its scale and, at element 4, the scale's reciprocal to (``scale_out``, or a fresh one)."""
    if scale_from_amax:
        if amax is None:
            raise ValueError("scale_from_amax: needs amax or amax_parts")
        if scale_out is None:
            scale_out = torch.empty(8, dtype=torch.float32, device=amax.device)
        elif (
            scale_out.dtype != torch.float32
            or scale_out.dim() != 1
            or scale_out.numel() < 5
            or scale_out.stride(0) != 1
            or scale_out.data_ptr() % 16
            or scale_out.device != amax.device
        ):
            raise ValueError(
                "scale_out: expected a contiguous 1-D float32 buffer of at least 5 elements, 16-byte "
                f"aligned, on {amax.device}; got {scale_out.dtype} {tuple(scale_out.shape)} "
                f"on {scale_out.device}"
            )
        return scale_out[0]
    if scale is None:
        raise ValueError("scale: required unless scale_from_amax")
    return scale if scale.dtype == torch.float32 else scale.to(torch.float32)
