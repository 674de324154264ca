"""Fused quantize + statistics in one pass over the input (Triton), delayed or current scaling.

Contract: exactly ``fp8_kernels.quantize.quantize_with_stats_reference`` (same statistics row, same bits):
each element is read once, ``v = clamp(x * scale, -FP8_MAX, FP8_MAX)`` (NaN kept) is computed in float32 and
cast to FP8 with round-to-nearest-even, and the element's contribution to the statistics is counted from
``|x|`` and ``|x * scale|`` on the way. Optionally the same pass writes the transposed FP8 tensor (the
operand layout the backward GEMMs want) and, for tests, the pre-cast values ``v`` themselves.

Why the bit tricks: ``amax`` is a max over the bit patterns of ``|x|`` (integer order equals float order for
non-negative floats, and a NaN sorts above Inf), which propagates NaN identically on a GPU (where the float
``max`` ignores NaN) and in the interpreter (where it propagates it). The same trick accumulates the float64
``amax`` column across calls with an integer atomic max. Counts are float64 atomic adds of integers, exact
below 2**53 and independent of order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize import KERNEL_MAX_NUMEL
from .triton_launch import as_kernel_input, block_1d, format_constants, grid_cap, load_f32, tile_2d

__all__ = ["launch_quantize", "quantize_with_stats_transposed_triton", "quantize_with_stats_triton"]

MAX_NUMEL = KERNEL_MAX_NUMEL


@triton.jit
def _scale_and_count(x, scale, FMAX: tl.constexpr, UNDERFLOW: tl.constexpr):
    """One element's ``(|x| bits, overflow, underflow, nonfinite, pre-cast value)``."""
    ax_bits = tl.abs(x).to(tl.int32, bitcast=True)
    nonfinite = ax_bits >= 0x7F800000  # exponent all ones: Inf or NaN
    xs = x * scale
    a = tl.abs(xs)
    overflow = (a > FMAX) & (ax_bits < 0x7F800000)  # includes finite x whose product overflowed to Inf
    underflow = (a <= UNDERFLOW) & (ax_bits != 0)  # non-zero, rounds to zero; NaN compares False
    # explicit NaN pass-through: a GPU's min/max would turn NaN into the bound
    v = tl.where(xs != xs, xs, tl.minimum(tl.maximum(xs, -FMAX), FMAX))
    return ax_bits, overflow.to(tl.int32), underflow.to(tl.int32), nonfinite.to(tl.int32), v


@triton.jit
def _load_scale(scale_ptr, amax_ptr, FMAX: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr):
    """The scale: given, or (current scaling) ``FP8_MAX / amax`` clamped, 1 for a zero/non-finite amax."""
    if SCALE_FROM_AMAX:
        amax = tl.abs(tl.load(amax_ptr).to(tl.float32))
        s = tl.minimum(tl.math.div_rn(FMAX + tl.zeros_like(amax), amax), 3.4028234663852886e38)
        ok = (amax > 0) & (amax.to(tl.int32, bitcast=True) < 0x7F800000)
        return tl.where(ok, s, 1.0)
    else:
        return tl.load(scale_ptr).to(tl.float32)


@triton.jit
def _accumulate_stats(stats_ptr, amax_ptr, scale_out_ptr, amax_bits, overflow, underflow, nonfinite, scale, n,
                      HAS_AMAX: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr):
    """Fold one program's totals into the float64 statistics row (columns ``STAT_COLUMNS``)."""
    pid = tl.program_id(0)
    amax_slot = stats_ptr.to(tl.pointer_type(tl.int64))  # the amax column, as bits
    if HAS_AMAX:
        if pid == 0:
            a = tl.abs(tl.load(amax_ptr).to(tl.float32))
            tl.atomic_max(amax_slot, a.to(tl.float64).to(tl.int64, bitcast=True))
    else:
        a = amax_bits.to(tl.float32, bitcast=True)
        tl.atomic_max(amax_slot, a.to(tl.float64).to(tl.int64, bitcast=True))
    tl.atomic_add(stats_ptr + 2, overflow.to(tl.float64))
    tl.atomic_add(stats_ptr + 3, underflow.to(tl.float64))
    tl.atomic_add(stats_ptr + 4, nonfinite.to(tl.float64))
    if pid == 0:
        tl.store(stats_ptr + 1, scale.to(tl.float64))
        tl.atomic_add(stats_ptr + 5, n.to(tl.float64))
        if SCALE_FROM_AMAX:
            tl.store(scale_out_ptr, scale)


@triton.jit(do_not_specialize=["n"])
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, amax_ptr, stats_ptr, precast_ptr, scale_out_ptr, n,
                     FMAX: tl.constexpr, UNDERFLOW: tl.constexpr, HAS_AMAX: tl.constexpr,
                     SCALE_FROM_AMAX: tl.constexpr, STORE_PRECAST: tl.constexpr, IS_BF16: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    scale = _load_scale(scale_ptr, amax_ptr, FMAX, SCALE_FROM_AMAX)
    amax_acc = tl.zeros([BLOCK], dtype=tl.int32)
    ovf_acc = tl.zeros([BLOCK], dtype=tl.int32)
    unf_acc = tl.zeros([BLOCK], dtype=tl.int32)
    nonf_acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = load_f32(x_ptr, offs, mask, IS_BF16)
        bits, ovf, unf, nonf, v = _scale_and_count(x, scale, FMAX, UNDERFLOW)
        amax_acc = tl.maximum(amax_acc, bits)
        ovf_acc += ovf
        unf_acc += unf
        nonf_acc += nonf
        tl.store(q_ptr + offs, v.to(q_ptr.dtype.element_ty), mask=mask)
        if STORE_PRECAST:
            tl.store(precast_ptr + offs, v, mask=mask)
    _accumulate_stats(stats_ptr, amax_ptr, scale_out_ptr, tl.max(amax_acc, axis=0), tl.sum(ovf_acc, axis=0),
                      tl.sum(unf_acc, axis=0), tl.sum(nonf_acc, axis=0), scale, n, HAS_AMAX, SCALE_FROM_AMAX)


@triton.jit(do_not_specialize=["M", "N"])
def _quantize_t_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, stats_ptr, precast_ptr, scale_out_ptr, M, N,
                       FMAX: tl.constexpr, UNDERFLOW: tl.constexpr, HAS_AMAX: tl.constexpr,
                       SCALE_FROM_AMAX: tl.constexpr, STORE_PRECAST: tl.constexpr, IS_BF16: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    scale = _load_scale(scale_ptr, amax_ptr, FMAX, SCALE_FROM_AMAX)
    tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    amax_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    ovf_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    unf_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    nonf_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for t in range(pid, n_tiles, nprog):
        rm = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None] * N + rn[None, :]
        x = load_f32(x_ptr, offs, mask, IS_BF16)
        bits, ovf, unf, nonf, v = _scale_and_count(x, scale, FMAX, UNDERFLOW)
        amax_acc = tl.maximum(amax_acc, bits)
        ovf_acc += ovf
        unf_acc += unf
        nonf_acc += nonf
        q = v.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + offs, q, mask=mask)
        # the transposed tile, stored row by row of the transpose (coalesced along M)
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
        if STORE_PRECAST:
            tl.store(precast_ptr + offs, v, mask=mask)
    _accumulate_stats(stats_ptr, amax_ptr, scale_out_ptr, tl.max(tl.max(amax_acc, axis=1), axis=0),
                      tl.sum(tl.sum(ovf_acc, axis=1), axis=0), tl.sum(tl.sum(unf_acc, axis=1), axis=0),
                      tl.sum(tl.sum(nonf_acc, axis=1), axis=0), scale, M * N, HAS_AMAX, SCALE_FROM_AMAX)


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
        return torch.zeros(6, dtype=torch.float64, device=x.device)
    if stats.dtype != torch.float64 or stats.shape != (6,) or not stats.is_contiguous():
        raise ValueError(
            f"stats: expected a contiguous float64 (6,) row, got {stats.dtype} {tuple(stats.shape)}"
        )
    return stats


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
    scale_from_amax: bool = False,
    precast: torch.Tensor | None = None,
    transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Run the fused kernel; ``(q, qt or None, stats_row, scale used as a float32 0-dim tensor)``.

    Args:
        scale_from_amax: current scaling in-kernel: the scale is ``FP8_MAX / amax`` clamped to the float32
            maximum, 1 for a zero or non-finite ``amax`` (``amax`` required, ``scale`` ignored).
        precast: optional contiguous float32 tensor of ``x``'s shape that receives the clamped ``x * scale``
            values before the FP8 cast (for exact comparisons where the cast itself cannot be trusted).
        transpose: also write ``q.t().contiguous()`` in the same pass (2-D ``x`` only).
    """
    row = _check(x, scale, stats, precast, amax)
    _check_precast(precast, x)
    if transpose and x.dim() != 2:
        raise ValueError(f"x: the transposed output needs a 2-D tensor, got shape {tuple(x.shape)}")
    fmax, underflow = format_constants(fp8_dtype)
    scale_t = _scale_operand(scale, amax, scale_from_amax)
    xc, is_bf16 = as_kernel_input(x)
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    flags = dict(
        FMAX=fmax, UNDERFLOW=underflow, HAS_AMAX=amax is not None, SCALE_FROM_AMAX=scale_from_amax,
        STORE_PRECAST=precast is not None, IS_BF16=is_bf16,
    )
    amax_arg = amax if amax is not None else scale_t
    precast_arg = precast if precast is not None else q
    if not transpose:
        n = xc.numel()
        block, warps = block_1d(x.device)
        grid = (max(1, min(triton.cdiv(n, block), grid_cap(x.device))),)
        _quantize_kernel[grid](
            xc, q, scale_t, amax_arg, row, precast_arg, scale_t, n, BLOCK=block, num_warps=warps, **flags
        )
        return q, None, row, scale_t
    m, n = xc.shape
    qt = torch.empty((n, m), dtype=fp8_dtype, device=x.device)
    bm, bn, warps = tile_2d(x.device)
    grid = (max(1, min(triton.cdiv(m, bm) * triton.cdiv(n, bn), grid_cap(x.device))),)
    _quantize_t_kernel[grid](
        xc, q, qt, scale_t, amax_arg, row, precast_arg, scale_t, m, n,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **flags,
    )  # fmt: skip
    return q, qt, row, scale_t


def quantize_with_stats_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``quantize_with_stats_reference`` (same arguments, same ``(q, stats_row)``)."""
    q, _, row, _ = launch_quantize(x, scale, fp8_dtype, stats, amax=amax)
    return q, row


def quantize_with_stats_transposed_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``quantize_with_stats_triton`` for a 2-D ``x``, also returning ``q.t().contiguous()`` written by
    the same pass: ``(q, qt, stats_row)``."""
    q, qt, row, _ = launch_quantize(x, scale, fp8_dtype, stats, amax=amax, transpose=True)
    return q, qt, row


def _scale_operand(scale, amax, scale_from_amax: bool) -> torch.Tensor:
    """The scale the kernel reads, or (current scaling) the fresh 0-dim buffer it writes its scale to."""
    if scale_from_amax:
        if amax is None:
            raise ValueError("scale_from_amax: needs amax")
        return torch.empty((), dtype=torch.float32, device=amax.device)
    if scale is None:
        raise ValueError("scale: required unless scale_from_amax")
    return scale if scale.dtype == torch.float32 else scale.to(torch.float32)
