"""Block-scaled FP8: MXFP8 (1x32 blocks, E8M0 scales) and FP8 block scaling (1x128 / 128x128, float32
scales), Transformer Engine semantics, emulated in PyTorch on any device. The CPU path, and the specification
a Triton kernel will be tested against.

One primitive, ``quantize_blocks``, quantizes a 2-D tensor with one scale per ``(bm, bn)`` block; the recipe
helpers (``mxfp8_quantize``, ``float8_block_quantize``) pick the blocks and the copies Transformer Engine
makes. docs/fp8-semantics.md ("Block-scaled recipes") says where each rule comes from in TE's source.

Numerics, per block (``amax = max |x|`` over the block, NaN elements ignored as ``fmaxf`` does, Inf kept):

* E8M0 (MXFP8): ``code = e8m0_from_amax(amax)`` is the biased exponent of ``amax * float32(1 / FP8_MAX)``
  rounded **up** to a power of two, saturated to 254 (2^127); 0 for a zero amax (the block scale is then
  2^-127), 254 for an Inf amax, 255 (NaN) for a NaN amax. Quantize: ``q = fp8_satfinite(x * 2^(127 - code))``;
  dequantize: ``q * 2^(code - 127)``.
* float32 (FP8 block scaling): ``amax = max(amax, amax_epsilon)``; ``scale = FP8_MAX / amax`` in float32,
  1 for a zero or Inf amax, the input dtype's largest finite value where the division overflows; with
  ``power_2_scale`` rounded down to a power of two (mantissa bits cleared). ``scale_inv = 1 / scale``.
  Quantize: ``q = fp8_satfinite(x * scale)``; dequantize: ``q * scale_inv``.
* ``fp8_satfinite``: round to nearest even; a finite value beyond the format saturates to ``+-FP8_MAX``, so
  does ``+-Inf``; NaN stays NaN (PTX ``cvt.rn.satfinite``).
* A block that runs past the edge of a tensor whose size is not a multiple of the block (FP8 block scaling)
  takes its amax over the elements that exist, as TE's kernel does (its reference pads with zeros, which
  cannot change a max of absolute values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from .quantize import fp8_max, overflow_threshold

__all__ = [
    "BlockQuantized",
    "BlockQuantizedPair",
    "E8M0_BIAS",
    "E8M0_NAN",
    "FP8_BLOCK",
    "MXFP8_BLOCK",
    "block_amax",
    "block_scaled_mm",
    "block_stats",
    "e8m0_from_amax",
    "e8m0_to_scale_inv",
    "e8m0_to_scale",
    "float32_block_scale",
    "float8_block_quantize",
    "mxfp8_quantize",
    "quantize_blocks",
]

#: MXFP8's block length (OCP MX v1.0 and TE's ``MXFP8_BLOCK_SCALING_SIZE``).
MXFP8_BLOCK = 32
#: FP8 block scaling's block length (TE's ``Float8BlockQuantizer.block_len``): 1x128 and 128x128 blocks.
FP8_BLOCK = 128
#: E8M0 stores ``exponent + 127``; code 255 is NaN, there is no zero and no sign.
E8M0_BIAS = 127
E8M0_NAN = 255
_E8M0_MAX_FINITE = 254

ScaleFormat = Literal["e8m0", "fp32"]


@dataclass(frozen=True)
class BlockQuantized:
    """One quantized copy of a 2-D tensor: FP8 ``data`` and one dequantization scale per block.

    ``data`` has the shape of the tensor it encodes (for TE's transposed column-wise copies, the transpose);
    ``block`` is the block shape in ``data``'s own coordinates; ``scale_inv`` has one entry per block,
    shape ``(ceil(rows / bm), ceil(cols / bn))`` (compact: TE pads and swizzles it for cuBLAS, a layout
    detail that changes no value). ``scale_inv`` holds E8M0 codes (uint8) for ``scale_format == "e8m0"``
    and float32 values for ``"fp32"``.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    scale_format: ScaleFormat

    def scale_inv_per_element(self) -> torch.Tensor:
        """The float32 dequantization factor of every element (shape of ``data``)."""
        s = e8m0_to_scale_inv(self.scale_inv) if self.scale_format == "e8m0" else self.scale_inv
        return _expand(s, self.block, self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * scale_inv`` of each element's block, in ``dtype`` (computed in float32).

        Where the blocks tile ``data`` exactly, each block's factor is broadcast over its block (an E8M0
        code looked up in a 256-entry table of ``e8m0_to_scale_inv``): the same float32 products in two ops
        (float32 scales) or four (E8M0), the GEMM emulation's per-operand cost, instead of a factor built
        for every element."""
        (bm, bn), (gm, gn) = self.block, self.scale_inv.shape
        m, n = self.data.shape
        if m != gm * bm or n != gn * bn or not self.data.numel():
            return (self.data.to(torch.float32) * self.scale_inv_per_element()).to(dtype)
        s = self.scale_inv
        if self.scale_format == "e8m0":
            s = _e8m0_scale_inv_table(s.device).index_select(0, s.reshape(-1).to(torch.int32))
        out = self.data.to(torch.float32).reshape(gm, bm, gn, bn) * s.reshape(gm, 1, gn, 1)
        return out.reshape(m, n).to(dtype)

    def t(self) -> BlockQuantized:
        """The same values transposed (data, scales and block shape): for 128x128 blocks TE's column-wise
        copy is exactly this."""
        return BlockQuantized(
            self.data.t().contiguous(), self.scale_inv.t().contiguous(), self.block[::-1], self.scale_format
        )


# --- block geometry -------------------------------------------------------------------------------------


def _grid(shape: torch.Size | tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _blocked(x: torch.Tensor, block: tuple[int, int], fill: float = 0.0) -> torch.Tensor:
    """``x`` padded with ``fill`` to whole blocks and viewed as ``(MB, NB, bm * bn)``."""
    (bm, bn), (gm, gn) = block, _grid(x.shape, block)
    pad_m, pad_n = gm * bm - x.shape[0], gn * bn - x.shape[1]
    if pad_m or pad_n:
        x = torch.nn.functional.pad(x, (0, pad_n, 0, pad_m), value=fill)
    return x.reshape(gm, bm, gn, bn).permute(0, 2, 1, 3).reshape(gm, gn, bm * bn)


def _expand(per_block: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """One value per block -> one per element of a tensor of ``shape``."""
    full = per_block.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


def _block_sum(mask: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return _blocked(mask.to(torch.int32), block).sum(dim=-1, dtype=torch.int64)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``max |x|`` per block as float32, NaN elements ignored (an all-NaN block: 0), Inf kept."""
    ax = torch.nan_to_num(x.to(torch.float32).abs(), nan=0.0, posinf=math.inf)
    b = _blocked(ax, block)
    return b.amax(dim=-1) if b.shape[-1] else b.new_zeros(b.shape[:2])


# --- scales ---------------------------------------------------------------------------------------------


def e8m0_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """MXFP8's shared exponent of each block (uint8 E8M0 code).

    ``v = amax * float32(1 / FP8_MAX)`` (one float32 multiply, as TE's kernels do), then ``v`` rounded up to
    a power of two and that power's biased exponent taken: a normal ``v`` with a non-zero mantissa goes one
    binade up; a subnormal ``v`` above 2^-127 becomes 2^-126 (code 1), one at or below 2^-127 code 0.
    Saturating: a finite ``v`` never rounds up past code 254. Zero: 0. Inf: 254. NaN: 255.
    """
    rcp = torch.tensor(1.0 / fp8_max(fp8_dtype), dtype=torch.float32, device=amax.device)
    v = amax.to(torch.float32) * rcp
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != _E8M0_MAX_FINITE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + up.to(torch.int32)
    code = torch.where(torch.isinf(v), _E8M0_MAX_FINITE, code)
    code = torch.where(torch.isnan(v), E8M0_NAN, code)
    return code.to(torch.uint8)


_E8M0_TABLES: dict[torch.device, torch.Tensor] = {}


def _e8m0_scale_inv_table(device: torch.device) -> torch.Tensor:
    """``e8m0_to_scale_inv`` of the 256 codes on ``device``, made once per device."""
    table = _E8M0_TABLES.get(device)
    if table is None:
        table = _E8M0_TABLES[device] = e8m0_to_scale_inv(torch.arange(256, dtype=torch.int32)).to(device)
    return table


def _float_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def e8m0_to_scale(code: torch.Tensor) -> torch.Tensor:
    """The quantization multiplier ``2^(127 - code)`` (float32), NaN for code 255.

    Built from bits: code 254 gives 2^-127, a float32 subnormal.
    """
    c = code.to(torch.int32)
    bits = torch.where(c == _E8M0_MAX_FINITE, 0x00400000, (254 - c).clamp(min=0) << 23)
    bits = torch.where(c == E8M0_NAN, 0x7FFFFFFF, bits)
    return _float_from_bits(bits)


def e8m0_to_scale_inv(code: torch.Tensor) -> torch.Tensor:
    """The dequantization factor ``2^(code - 127)`` (float32), NaN for code 255; code 0 gives 2^-127."""
    c = code.to(torch.int32)
    bits = torch.where(c == 0, 0x00400000, c << 23)
    bits = torch.where(c == E8M0_NAN, 0x7FFFFFFF, bits)
    return _float_from_bits(bits)


def float32_block_scale(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    power_2_scale: bool,
    amax_epsilon: float = 0.0,
    input_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FP8 block scaling's float32 scale of each block (TE's ``compute_scale_from_amax``).

    ``amax`` is first raised to ``amax_epsilon``; a zero or Inf amax (or NaN) gives 1; otherwise
    ``FP8_MAX / amax`` (one correctly rounded float32 division), replaced by ``input_dtype``'s largest finite
    value where it overflows to Inf; with ``power_2_scale`` the mantissa bits are then cleared.
    """
    amax = amax.to(torch.float32)
    amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
    scale = torch.full_like(amax, fp8_max(fp8_dtype)) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(input_dtype).max), scale)
    scale = torch.where(torch.isinf(amax) | (amax == 0) | torch.isnan(amax), torch.ones_like(scale), scale)
    if power_2_scale:
        scale = torch.bitwise_and(scale.view(torch.int32), -(2**23)).view(torch.float32)
    return scale


# --- quantization ---------------------------------------------------------------------------------------


def _satfinite_cast(xs: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    fmax = fp8_max(fp8_dtype)
    return xs.clamp(-fmax, fmax).to(fp8_dtype)  # clamp keeps NaN and sends +-Inf to +-FP8_MAX


def quantize_blocks(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    block: tuple[int, int],
    scale_format: ScaleFormat,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
) -> BlockQuantized:
    """Quantize a 2-D ``x`` with one scale per ``block`` (``(bm, bn)``, in ``x``'s coordinates).

    Args:
        x: 2-D float32, bfloat16 or float16 tensor (flatten leading dimensions first, as TE does).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block: block shape; a partial block at an edge is a block of the elements that exist.
        scale_format: ``"e8m0"`` (MXFP8) or ``"fp32"`` (FP8 block scaling).
        power_2_scale, amax_epsilon: FP8 block scaling's ``QParams`` (ignored for E8M0, which has neither).
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got shape {tuple(x.shape)}")
    if scale_format not in ("e8m0", "fp32"):
        raise ValueError(f"scale_format: expected 'e8m0' or 'fp32', got {scale_format!r}")
    amax = block_amax(x, block)
    if scale_format == "e8m0":
        scale_inv = e8m0_from_amax(amax, fp8_dtype)
        scale = e8m0_to_scale(scale_inv)
    else:
        scale = float32_block_scale(
            amax, fp8_dtype, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon, input_dtype=x.dtype
        )
        scale_inv = torch.ones_like(scale) / scale
    xs = x.to(torch.float32) * _expand(scale, block, x.shape)
    return BlockQuantized(_satfinite_cast(xs, fp8_dtype), scale_inv, tuple(block), scale_format)


@dataclass(frozen=True)
class BlockQuantizedPair:
    """The copies TE makes of one tensor: ``rowwise`` (blocks along the last dimension, for the GEMM that
    contracts it) and ``columnwise`` (blocks along the first, for the GEMM that contracts that one); either
    may be ``None`` when not asked for. Both are quantized from the high-precision input."""

    rowwise: BlockQuantized | None
    columnwise: BlockQuantized | None


def mxfp8_quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    two_d: bool = False,
) -> BlockQuantizedPair:
    """MXFP8 as TE's ``MXFP8Quantizer``: rowwise 1x32 blocks, columnwise 32x1 blocks (both copies in
    ``x``'s orientation, not transposed), E8M0 scales; ``two_d`` (TE's ``with_2d_quantization``, used for
    weights when ``MXFP8BlockScaling.enable_2d_quantization``) gives both copies the scale of their 32x32
    block. Both dimensions must be multiples of 32, as TE requires ("MXFP8 requires tensor dims that are
    divisible by 32")."""
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got shape {tuple(x.shape)}")
    if x.shape[0] % MXFP8_BLOCK or x.shape[1] % MXFP8_BLOCK:
        raise ValueError(f"x: MXFP8 needs both dimensions divisible by {MXFP8_BLOCK}, got {tuple(x.shape)}")
    b = MXFP8_BLOCK
    if two_d:
        sq = quantize_blocks(x, fp8_dtype, (b, b), "e8m0")
        # the same values, re-labelled per 1x32 / 32x1 block as TE stores them
        row = BlockQuantized(sq.data, sq.scale_inv.repeat_interleave(b, dim=0), (1, b), "e8m0")
        col = BlockQuantized(sq.data, sq.scale_inv.repeat_interleave(b, dim=1), (b, 1), "e8m0")
        return BlockQuantizedPair(row if rowwise else None, col if columnwise else None)
    return BlockQuantizedPair(
        quantize_blocks(x, fp8_dtype, (1, b), "e8m0") if rowwise else None,
        quantize_blocks(x, fp8_dtype, (b, 1), "e8m0") if columnwise else None,
    )


def float8_block_quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    block_scaling_dim: int,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = True,
) -> BlockQuantizedPair:
    """FP8 block scaling as TE's ``Float8BlockQuantizer``: ``block_scaling_dim=1`` gives 1x128 blocks
    (rowwise) and, for the column-wise copy, 1x128 blocks of ``x.T`` (i.e. 128x1 blocks of ``x``, stored
    transposed as TE does for its GEMMs); ``block_scaling_dim=2`` gives 128x128 blocks, whose column-wise copy
    is the row-wise one transposed. Sizes need not be multiples of 128."""
    if block_scaling_dim not in (1, 2):
        raise ValueError(f"block_scaling_dim: must be 1 or 2, got {block_scaling_dim!r}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got shape {tuple(x.shape)}")
    kw = {"power_2_scale": power_2_scale, "amax_epsilon": amax_epsilon}
    b = FP8_BLOCK
    if block_scaling_dim == 2:
        sq = quantize_blocks(x, fp8_dtype, (b, b), "fp32", **kw)
        return BlockQuantizedPair(sq if rowwise else None, sq.t() if columnwise else None)
    return BlockQuantizedPair(
        quantize_blocks(x, fp8_dtype, (1, b), "fp32", **kw) if rowwise else None,
        quantize_blocks(x.t(), fp8_dtype, (1, b), "fp32", **kw) if columnwise else None,
    )


# --- GEMM emulation -------------------------------------------------------------------------------------


def _k_block(q: BlockQuantized) -> int:
    return q.block[1]


def block_scaled_mm(
    a: BlockQuantized, b: BlockQuantized, *, accumulate: Literal["dequantize", "blockwise"] = "dequantize"
) -> torch.Tensor:
    """``A @ B.T`` in float32 for ``a`` (M, K) and ``b`` (N, K), both with blocks along K (TE's "TN" GEMM:
    fprop ``x @ w.T`` takes both row-wise copies).

    ``"dequantize"``: dequantize both, one float32 matmul. ``"blockwise"``: per K-block, the product of the
    FP8 values in float32, scaled by the two blocks' ``scale_inv`` and added to a float32 accumulator: how a
    block-scaled tensor-core GEMM promotes its partial sums (TE's split accumulator; DeepSeek-V3's
    per-128 promotion). The K-block lengths of ``a`` and ``b`` must agree.
    """
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"a, b: K differs ({a.data.shape[1]} vs {b.data.shape[1]})")
    if accumulate == "dequantize":
        return a.dequantize() @ b.dequantize().t()
    if accumulate != "blockwise":
        raise ValueError(f"accumulate: expected 'dequantize' or 'blockwise', got {accumulate!r}")
    kb = _k_block(a)
    if _k_block(b) != kb or kb <= 1:
        raise ValueError(f"a, b: blockwise accumulation needs equal K blocks, got {a.block} and {b.block}")

    def row_scales(q: BlockQuantized) -> torch.Tensor:  # (rows, K-blocks): the scale_inv each row uses
        s = e8m0_to_scale_inv(q.scale_inv) if q.scale_format == "e8m0" else q.scale_inv
        return s.repeat_interleave(q.block[0], dim=0)[: q.data.shape[0]]

    sa, sb = row_scales(a), row_scales(b)
    qa, qb = a.data.to(torch.float32), b.data.to(torch.float32)
    out = torch.zeros(qa.shape[0], qb.shape[0], dtype=torch.float32, device=qa.device)
    for j, k0 in enumerate(range(0, qa.shape[1], kb)):
        partial = qa[:, k0 : k0 + kb] @ qb[:, k0 : k0 + kb].t()
        out += partial * sa[:, j : j + 1] * sb[:, j].unsqueeze(0)
    return out


# --- statistics -----------------------------------------------------------------------------------------


def block_stats(x: torch.Tensor, q: BlockQuantized, fp8_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-block statistics of ``q``, the quantization of ``x`` (same orientation as ``q.data``).

    Returns a dict of tensors (no host read):

    * ``scale_exponent_hist``: int64 ``(256,)``, blocks per binade of their ``scale_inv``, indexed by the
      biased exponent (the E8M0 code itself; for float32 scales, their exponent field: 127 is [1, 2)).
    * ``e8m0_at_min`` / ``e8m0_at_max``: blocks whose E8M0 code is 0 (2^-127: the scale could go no lower,
      an all-zero block or an amax at most FP8_MAX * 2^-127) or 254 (2^127: an Inf amax); 0 for float32.
    * ``zero_blocks``: blocks whose amax is 0 (NaN ignored); ``nonfinite_blocks``: blocks holding NaN or Inf.
    * ``overflow``, ``underflow``, ``nonfinite``: int64 per-block counts, same rules as per-tensor scaling:
      finite elements whose cast really saturated (``|x * scale|`` beyond the rounding threshold); finite
      non-zero elements quantized to zero; NaN and Inf elements.
    * ``dynamic_range``: float32 per block, ``log2(max |x| / min |x|)`` over finite non-zero elements (0
      for a block with none). FP8 E4M3 spans log2(448 / 2^-9) ~ 17.8 binades: a block wider than that
      underflows some element whatever its scale. ``worst_dynamic_range``: its maximum.
    """
    block = q.block
    xf = x.to(torch.float32)
    finite = torch.isfinite(xf)
    scale_inv = q.scale_inv
    if q.scale_format == "e8m0":
        codes = scale_inv.to(torch.int64)
        at_min = torch.count_nonzero(codes == 0)
        at_max = torch.count_nonzero(codes == _E8M0_MAX_FINITE)
        scale = _expand(e8m0_to_scale(scale_inv), block, x.shape)
    else:
        codes = (scale_inv.view(torch.int32) >> 23).to(torch.int64) & 0xFF
        at_min = at_max = torch.zeros((), dtype=torch.int64, device=x.device)
        scale = _expand(torch.ones_like(scale_inv) / scale_inv, block, x.shape)
    threshold, inclusive = overflow_threshold(fp8_dtype)
    a = (xf * scale).abs()
    saturated = finite & ((a >= threshold) if inclusive else (a > threshold))
    underflow = finite & (xf != 0) & (q.data.to(torch.float32) == 0)
    ax = torch.where(finite, xf.abs(), torch.zeros_like(xf))
    big = _blocked(ax, block).amax(dim=-1)
    nonzero_or_inf = torch.where(ax > 0, ax, torch.full_like(ax, math.inf))
    small = _blocked(nonzero_or_inf, block, fill=math.inf).amin(dim=-1)
    has = big > 0
    drange = torch.where(has, torch.log2(big.double() / small.double()), 0.0).to(torch.float32)
    nonfinite = _block_sum(~finite, block)
    return {
        "scale_exponent_hist": torch.bincount(codes.flatten(), minlength=256),
        "e8m0_at_min": at_min,
        "e8m0_at_max": at_max,
        "zero_blocks": torch.count_nonzero(block_amax(x, block) == 0),
        "nonfinite_blocks": torch.count_nonzero(nonfinite),
        "overflow": _block_sum(saturated, block),
        "underflow": _block_sum(underflow, block),
        "nonfinite": nonfinite,
        "dynamic_range": drange,
        "worst_dynamic_range": drange.max() if drange.numel() else drange.new_zeros(()),
    }
