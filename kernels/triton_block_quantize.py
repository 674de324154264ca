"""Block-scaled quantization in Triton: one pass over a 2-D tensor writes the FP8 data, one ``scale_inv`` per
block and each block's statistics.

Contract: ``fp8_kernels.block_quantize.quantize_blocks`` bit for bit (the FP8 data and ``scale_inv``) for
row-wise ``1 x B`` blocks (MXFP8's 1x32 with E8M0 scales, FP8 block scaling's 1x128 with float32 scales)
and square ``B x B`` blocks (32x32 E8M0, 128x128 float32), any size (a partial block at an edge is a block
of the elements that exist). The numerics, per block, are the reference's (its module docstring):

* amax: a max over the bit patterns of ``|x|`` with NaN patterns read as 0 (NaN ignored, Inf kept), the
  same on every backend (``triton_launch.amax_bits``).
* E8M0: ``v = amax * float32(1 / FP8_MAX)``, rounded up to a power of two on its bits (subnormal ``v`` at
  or below 2^-127: code 0; Inf: 254); the multiplier ``2^(127 - code)`` built from bits (2^-127 for 254).
* float32: ``max(amax, amax_epsilon)``, ``FP8_MAX / amax`` correctly rounded (``div_rn``), the input
  dtype's largest finite value where that overflows, 1 for a zero or Inf amax, optionally the mantissa
  cleared; ``scale_inv = 1 / scale`` correctly rounded.
* ``q = fp8_satfinite(x * scale)``: the float32 product clamped to ``+-FP8_MAX`` (NaN kept), rounded to the
  format *arithmetically*, the sign put back on the bits, then cast (``triton_quantize._fp8_rounded``): the
  cast only meets values the format holds exactly, so it cannot round differently on a GPU and under the
  interpreter (whose float8 cast rounds some values wrongly).

Statistics, per block, with no host synchronisation (``block_quantize_triton`` returns them;
``fp8_trainer.block_linear.block_tensor_stats_from_kernel`` folds them into the statistics row and block
part the block-scaled Linear records): ``amax``; ``big`` / ``small`` the largest / smallest non-zero
finite ``|x|`` (``small`` Inf where there is none); ``counts`` int64 with four 16-bit fields
(``dispatch.BLOCK_COUNT_FIELDS``; a 128x128 block has 2^14 elements): overflow (finite values whose cast
saturated), underflow (finite non-zero values quantized to zero), non-finite, subnormal (landed on a
non-zero FP8 subnormal); with ``QUALITY`` ``sum_sq`` and ``err_sq`` in float64 (each square of a float32
exact in float64; the error ``q * scale_inv - x`` in float32 as the reference computes it, which a GPU may
contract into one FMA: the sums are compared within a bound, never bit for bit). The per-block output is
21 to 24 bytes a block (37 to 40 with the quality sums): 0.7 (1.2) bytes an element for 1x32 blocks, next
to the 2 of a bfloat16 input and the 1 of the FP8 output; folding them per program would save most of it.

Memory access: each program quantizes one tile (``TILE_M`` rows of one 1 x B column of blocks, or one
B x B block); a tile wholly inside the tensor loads and stores with no mask (16-byte vectors where rows
start aligned, made visible by the ``DIV_N`` constexpr as in ``triton_launch``), edge tiles masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_quantize import BlockQuantized
from .quantize import KERNEL_MAX_NUMEL, fp8_max
from .triton_launch import abs_bits, as_kernel_input, divisor, format_constants, launch, load_f32
from .triton_quantize import _fp8_rounded

__all__ = ["block_quantize_triton", "block_tile"]


def _f32(v: float) -> float:
    """``v`` rounded to float32, as the reference's float32 tensors hold it."""
    return float(torch.tensor(v, dtype=torch.float32))


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
    amax, FMAX: tl.constexpr, RCP_FMAX: tl.constexpr, E8M0: tl.constexpr, POW2_SCALE: tl.constexpr,
    AMAX_EPS: tl.constexpr, INPUT_MAX: tl.constexpr,
):  # fmt: skip
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
def _tile(
    x_ptr, q_ptr, scale_inv_ptr, amax_ptr, big_ptr, small_ptr, counts_ptr, sum_sq_ptr, err_sq_ptr,
    tm, tn, M, N, GN,
    MASKED: tl.constexpr, TWO_D: tl.constexpr, E8M0: tl.constexpr, POW2_SCALE: tl.constexpr,
    AMAX_EPS: tl.constexpr, INPUT_MAX: tl.constexpr, RCP_FMAX: tl.constexpr, FMAX: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr, OVF_INCLUSIVE: tl.constexpr, SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, DROP: tl.constexpr, QUALITY: tl.constexpr,
    STATS: tl.constexpr, IS_BF16: tl.constexpr, TILE_M: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    rm = tm * TILE_M + tl.arange(0, TILE_M)
    rn = tn * BN + tl.arange(0, BN)
    offs = rm[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N) if MASKED else None
    x = load_f32(x_ptr, offs, mask, IS_BF16)  # masked-out elements: 0, which counts as nothing
    ax_bits = abs_bits(x)
    finite = ax_bits < 0x7F800000
    amax = _block_reduce_max(tl.where(ax_bits > 0x7F800000, 0, ax_bits), TWO_D).to(tl.float32, bitcast=True)
    scale, inv, stored = _scales(amax, FMAX, RCP_FMAX, E8M0, POW2_SCALE, AMAX_EPS, INPUT_MAX)
    xs = x * _per_row(scale, TWO_D)
    q8, q = _fp8_rounded(xs, q_ptr.dtype.element_ty, FMAX, MIN_NORMAL, SUB_MAGIC, DROP)
    tl.store(q_ptr + offs, q8, mask=mask)
    r = tl.abs(q)  # |q| as float32 (meaningless for NaN, which is not finite)
    # per-block outputs: one per row of the tile (1 x B blocks) or one for the tile (a B x B block)
    if TWO_D:
        slot = tm * GN + tn
        smask = None
    else:
        slot = rm * GN + tn
        smask = rm < M
    tl.store(scale_inv_ptr + slot, stored, mask=smask)
    if STATS:
        tl.store(amax_ptr + slot, amax, mask=smask)
        fbits = tl.where(finite, ax_bits, 0)
        tl.store(big_ptr + slot, _block_reduce_max(fbits, TWO_D).to(tl.float32, bitcast=True), mask=smask)
        low = tl.where(finite & (ax_bits != 0), ax_bits, 0x7F800000)
        tl.store(small_ptr + slot, _block_reduce_min(low, TWO_D).to(tl.float32, bitcast=True), mask=smask)
        sa = tl.abs(xs)
        big = sa >= OVF_THRESHOLD if OVF_INCLUSIVE else sa > OVF_THRESHOLD
        overflow = _block_reduce_sum((big & finite).to(tl.int32), TWO_D)
        underflow = _block_reduce_sum((finite & (ax_bits != 0) & (r == 0)).to(tl.int32), TWO_D)
        nonfinite = _block_reduce_sum((~finite).to(tl.int32), TWO_D)
        subnormal = _block_reduce_sum((finite & (r > 0) & (r < SUBNORMAL_TOP)).to(tl.int32), TWO_D)
        counts = (
            overflow.to(tl.int64)
            | (underflow.to(tl.int64) << 16)
            | (nonfinite.to(tl.int64) << 32)
            | (subnormal.to(tl.int64) << 48)
        )
        tl.store(counts_ptr + slot, counts, mask=smask)
        if QUALITY:
            af = tl.where(finite, tl.abs(x), 0.0).to(tl.float64)
            err = tl.where(finite, q * _per_row(inv, TWO_D) - x, 0.0).to(tl.float64)
            tl.store(sum_sq_ptr + slot, _block_reduce_sum(af * af, TWO_D), mask=smask)
            tl.store(err_sq_ptr + slot, _block_reduce_sum(err * err, TWO_D), mask=smask)


@triton.jit(do_not_specialize=["M", "N"])
def _block_quantize_kernel(
    x_ptr, q_ptr, scale_inv_ptr, amax_ptr, big_ptr, small_ptr, counts_ptr, sum_sq_ptr, err_sq_ptr, M, N,
    TWO_D: tl.constexpr, E8M0: tl.constexpr, POW2_SCALE: tl.constexpr, AMAX_EPS: tl.constexpr,
    INPUT_MAX: tl.constexpr, RCP_FMAX: tl.constexpr, FMAX: tl.constexpr, UNDERFLOW: tl.constexpr,
    OVF_THRESHOLD: tl.constexpr, OVF_INCLUSIVE: tl.constexpr, SUBNORMAL_TOP: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, DROP: tl.constexpr, QUALITY: tl.constexpr,
    STATS: tl.constexpr, IS_BF16: tl.constexpr, DIV_N: tl.constexpr, TILE_M: tl.constexpr,
    BN: tl.constexpr,
):  # fmt: skip
    """One tile per program: program ``pid`` takes tile row ``pid // GN``, block column ``pid % GN``."""
    N = (N // DIV_N) * DIV_N  # exact (the launcher checked), and visible: rows start 16-element aligned
    GN = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    tm = pid // GN
    tn = pid % GN
    if ((tm + 1) * TILE_M <= M) & ((tn + 1) * BN <= N):
        _tile(
            x_ptr, q_ptr, scale_inv_ptr, amax_ptr, big_ptr, small_ptr, counts_ptr, sum_sq_ptr, err_sq_ptr,
            tm, tn, M, N, GN, False, TWO_D, E8M0, POW2_SCALE, AMAX_EPS, INPUT_MAX, RCP_FMAX, FMAX,
            OVF_THRESHOLD, OVF_INCLUSIVE, SUBNORMAL_TOP, MIN_NORMAL, SUB_MAGIC, DROP, QUALITY, STATS,
            IS_BF16, TILE_M, BN,
        )  # fmt: skip
    else:
        _tile(
            x_ptr, q_ptr, scale_inv_ptr, amax_ptr, big_ptr, small_ptr, counts_ptr, sum_sq_ptr, err_sq_ptr,
            tm, tn, M, N, GN, True, TWO_D, E8M0, POW2_SCALE, AMAX_EPS, INPUT_MAX, RCP_FMAX, FMAX,
            OVF_THRESHOLD, OVF_INCLUSIVE, SUBNORMAL_TOP, MIN_NORMAL, SUB_MAGIC, DROP, QUALITY, STATS,
            IS_BF16, TILE_M, BN,
        )  # fmt: skip


def block_quantize_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    block: tuple[int, int],
    scale_format: str,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    stats: bool = False,
    quality: bool = True,
) -> tuple[BlockQuantized, dict[str, torch.Tensor] | None]:
    """Triton twin of ``quantize_blocks`` (same arguments, same bits): ``(q, per_block)``.

    ``block`` ``(1, B)`` or ``(B, B)``. With ``stats`` ``per_block`` holds, shaped as ``q.scale_inv``:
    ``amax``, ``big``, ``small`` (float32), ``counts`` (int64, four 16-bit fields: overflow, underflow,
    non-finite, subnormal) and with ``quality`` ``sum_sq`` and ``err_sq`` (float64); else ``None``.
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
    M, N = x.shape
    gm, gn = -(-M // bm), -(-N // bn)
    dev = x.device
    q = torch.empty((M, N), dtype=fp8_dtype, device=dev)
    e8m0 = scale_format == "e8m0"
    scale_inv = torch.empty((gm, gn), dtype=torch.uint8 if e8m0 else torch.float32, device=dev)
    if stats:
        per_block = {
            "amax": torch.empty((gm, gn), dtype=torch.float32, device=dev),
            "big": torch.empty((gm, gn), dtype=torch.float32, device=dev),
            "small": torch.empty((gm, gn), dtype=torch.float32, device=dev),
            "counts": torch.empty((gm, gn), dtype=torch.int64, device=dev),
        }
        if quality:
            per_block["sum_sq"] = torch.empty((gm, gn), dtype=torch.float64, device=dev)
            per_block["err_sq"] = torch.empty((gm, gn), dtype=torch.float64, device=dev)
    else:
        per_block = None
    if M and N:
        xc, is_bf16 = as_kernel_input(x)
        tile_m, warps = block_tile(dev, block)
        p = per_block or {}
        dummy = scale_inv
        launch(
            _block_quantize_kernel, -(-M // tile_m) * gn, xc, q, scale_inv,
            p.get("amax", dummy), p.get("big", dummy), p.get("small", dummy), p.get("counts", dummy),
            p.get("sum_sq", dummy), p.get("err_sq", dummy), M, N,
            TWO_D=bm > 1, E8M0=e8m0, POW2_SCALE=bool(power_2_scale), AMAX_EPS=_f32(amax_epsilon),
            INPUT_MAX=float(torch.finfo(x.dtype).max), RCP_FMAX=_f32(1.0 / fp8_max(fp8_dtype)),
            **format_constants(fp8_dtype), QUALITY=bool(stats and quality), STATS=bool(stats),
            IS_BF16=is_bf16, DIV_N=divisor(N), TILE_M=tile_m, BN=bn, num_warps=warps,
        )  # fmt: skip
    elif per_block is not None:
        for v in per_block.values():
            v.zero_()
    return BlockQuantized(q, scale_inv, (bm, bn), scale_format), per_block
