"""Block-scaled FP8 ``Linear``: MXFP8 (1x32 blocks, E8M0 scales) and FP8 block scaling (1x128 / 128x128
blocks, float32 scales), Transformer Engine semantics, on the numerics of
``fp8_kernels.reference.block_quantize``.

Which copy of each tensor feeds which GEMM (TE's ``general_gemm`` layouts, docs/fp8-semantics.md; ``x``
flattened to ``(tokens, in)``, ``w`` ``(out, in)``, ``g`` = grad_output ``(tokens, out)``)::

    fprop  output      = row(x) @ row(w)^T     both contract ``in``:     blocks along the last dimension
    dgrad  grad_input  = row(g) @ col(w)^T     contract ``out``:         w's blocks along its first dimension
    wgrad  grad_weight = col(g) @ col(x)^T     contract ``tokens``:      x's and g's along their first one
           grad_bias   = g.sum(0)              high precision

``row(t)`` has blocks along ``t``'s last dimension (1x32, 1x128, or 32x32 / 128x128 for 2-D weights);
``col(t)`` along its first (32x1, 128x1, or the same square blocks), both quantized from the high-precision
tensor, as TE does. Every operand is held here as ``(rows, K)`` with its blocks along K, the contracted
dimension (``col(t)`` is stored transposed, as TE's FP8 block-scaling copies are; TE keeps MXFP8's
column-wise copy in the tensor's orientation, a layout difference that changes no value). Forward makes
the column-wise copies only where a backward GEMM needs them (x's when the weight needs a gradient, w's when
the input does), and saves them in FP8 with their scales.

GEMM: ``block_gemm`` (``block_gemm.py``): PyTorch's block-scaled ``scaled_mm`` where the GPU has one (FP8
block scaling on sm_90, MXFP8 on sm_100+, E4M3 operands, the sizes it takes), else
``block_scaled_mm(..., accumulate="dequantize")``: both operands dequantized (each FP8 value times its
block's power-of-two scale is exact in float32) and one float32 matmul. A block-scaled tensor-core GEMM
promotes its partial sums to float32 per K-block (TE's split accumulator), which ``accumulate="blockwise"``
emulates with one matmul per K-block; on a CPU that is K / 32 matmuls per GEMM for MXFP8, and float32
accumulation of exact products is at least as precise, so the one-matmul form is the emulation here.
``block_gemm.gemm_paths()`` says which path each of the three GEMMs took.

Statistics (recorded into the step's row, with no host synchronisation): the base and quality columns per
element (``fp8_protocol.stats``), with ``scale`` that of the block holding the amax, plus the six
``BLOCK_COLUMNS`` and the 256-bin scale exponent histogram, all of the row-wise copy (for a 2-D-scaled
weight, of its square blocks). Where a kernel is registered (CUDA) it merges them into the rows itself
(``fp8_kernels.triton.block_quantize``: the quantize launch and a one-program fold); elsewhere
``block_tensor_stats`` computes them in eager ops from ``x`` and the reference's ``q`` (the oracle the
kernel is tested against) and ``merge_block_row`` merges them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8_kernels.dispatch import block_quantize
from fp8_kernels.reference.block_quantize import (
    FP8_BLOCK,
    MXFP8_BLOCK,
    BlockQuantized,
    e8m0_to_scale,
    e8m0_to_scale_inv,
    float32_block_scale,
)
from fp8_kernels.reference.quantize import overflow_threshold, subnormal_threshold
from fp8_protocol.stats import BLOCK_COLUMNS, BLOCK_HIST_BINS, STAT_COLUMNS

from .block_gemm import block_gemm
from .formats import ROLES
from .recipe import Float8BlockScaling, MXFP8BlockScaling

__all__ = [
    "BLOCK_WIDTH",
    "BlockSpec",
    "block_specs",
    "new_block_stats",
    "quantize_block_tensor",
    "split_block_stats",
]

#: Width of a tensor's block part of the statistics: the six ``BLOCK_COLUMNS`` then the histogram bins.
BLOCK_WIDTH = len(BLOCK_COLUMNS) + BLOCK_HIST_BINS
_BLOCK_RANGE = BLOCK_COLUMNS.index("block_range")


@dataclass(frozen=True)
class BlockSpec:
    """How one tensor is block-scaled: ``scale_format`` ``"e8m0"`` (MXFP8) or ``"fp32"`` (FP8 block
    scaling), ``block`` the block length, ``two_d`` square blocks (weights), ``power_2_scale`` and
    ``amax_epsilon`` (FP8 block scaling's ``QParams``; E8M0 scales are powers of two anyway)."""

    scale_format: str
    block: int
    two_d: bool = False
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def row_block(self) -> tuple[int, int]:
        return (self.block, self.block) if self.two_d else (1, self.block)


def block_specs(scaling: str, base_recipe) -> tuple[BlockSpec, BlockSpec, BlockSpec]:
    """The ``(input, weight, grad_output)`` specs of a layer whose ``scaling`` is ``"mxfp8"`` or ``"block"``:
    from ``base_recipe`` when it is that block recipe, from Transformer Engine's defaults otherwise (a
    per-tensor base recipe with one layer switched to block scaling)."""
    if scaling == "mxfp8":
        r = base_recipe if isinstance(base_recipe, MXFP8BlockScaling) else MXFP8BlockScaling()
        return tuple(
            BlockSpec("e8m0", MXFP8_BLOCK, two_d=r.enable_2d_quantization and role == "weight")
            for role in ROLES
        )
    if scaling == "block":
        r = base_recipe if isinstance(base_recipe, Float8BlockScaling) else Float8BlockScaling()
        return tuple(
            BlockSpec(
                "fp32",
                FP8_BLOCK,
                two_d=r.block_scaling_dim(role) == 2,
                power_2_scale=r.qparams(role).power_2_scale,
                amax_epsilon=r.qparams(role).amax_epsilon,
            )
            for role in ROLES
        )
    raise ValueError(f"scaling: {scaling!r} is not block-scaled")


def new_block_stats(n: int, device=None) -> torch.Tensor:
    """A fresh ``(n, BLOCK_WIDTH)`` float64 block part (zeros: what a per-tensor-scaled tensor reports)."""
    return torch.zeros(n, BLOCK_WIDTH, dtype=torch.float64, device=device)


def split_block_stats(stats):
    """``(statistics, block part or None)`` of a step's statistics: the block part is the last
    ``BLOCK_WIDTH`` columns of a block wider than the statistics columns (torch or numpy)."""
    if stats is None or stats.shape[-1] <= len(STAT_COLUMNS):
        return stats, None
    return stats[..., :-BLOCK_WIDTH], stats[..., -BLOCK_WIDTH:]


# --- quantization ---------------------------------------------------------------------------------------


def _quantize(t: torch.Tensor, fp8_dtype: torch.dtype, spec: BlockSpec, block: tuple[int, int], rows=None):
    """``(q, recorded)``: the registered kernel for ``t``'s device (``fp8_kernels.dispatch``), which given
    ``rows`` (``{"stats": row, "block_stats": block row}``) merges the statistics into them in the same pass
    (``recorded`` True); else the reference, which records nothing."""
    return block_quantize(
        t,
        fp8_dtype,
        block,
        spec.scale_format,
        power_2_scale=spec.power_2_scale,
        amax_epsilon=spec.amax_epsilon,
        **(rows or {}),
    )


def check_mxfp8_shape(t: torch.Tensor, what: str) -> None:
    """MXFP8 needs both dimensions of every quantized 2-D tensor divisible by 32 (TE refuses others)."""
    if t.shape[0] % MXFP8_BLOCK or t.shape[1] % MXFP8_BLOCK:
        raise ValueError(
            f"{what}: MXFP8 needs both dimensions divisible by {MXFP8_BLOCK}, got {tuple(t.shape)} "
            "(Transformer Engine refuses such tensors too; for the input the first dimension is the token "
            "count, batch x sequence length)"
        )


def quantize_block_tensor(
    t: torch.Tensor,
    fp8_dtype: torch.dtype,
    spec: BlockSpec,
    *,
    rowwise: bool,
    columnwise: bool,
    stats: torch.Tensor | None = None,
    block_stats_row: torch.Tensor | None = None,
) -> tuple[BlockQuantized | None, BlockQuantized | None]:
    """Quantize a 2-D ``t`` ``(M, K)`` as ``spec`` says: ``(row, col)``, ``row`` ``(M, K)`` with blocks along
    K, ``col`` ``(K, M)`` with blocks along M (``t``'s column-wise copy, transposed), each ``None`` unless
    asked for. With ``stats`` (a ``(10,)`` or ``(6,)`` float64 row) and ``block_stats_row``
    (``(BLOCK_WIDTH,)``) the row-wise copy's statistics are merged into them (the row-wise copy is then made
    even if not asked for)."""
    rows = (
        None if stats is None or block_stats_row is None else {"stats": stats, "block_stats": block_stats_row}
    )
    if spec.two_d:
        # one copy serves both GEMMs
        square, recorded = _quantize(t, fp8_dtype, spec, (spec.block, spec.block), rows)
        row, col = square, (square.t() if columnwise else None)
    else:
        row, recorded = None, False
        if rowwise or stats is not None:
            row, recorded = _quantize(t, fp8_dtype, spec, (1, spec.block), rows)
        col = _quantize(t.t(), fp8_dtype, spec, (1, spec.block))[0] if columnwise else None
    if stats is not None and not recorded:
        record_block_stats(t, row, fp8_dtype, spec, stats, block_stats_row)
    return (row if rowwise else None), col


# --- statistics -----------------------------------------------------------------------------------------


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` zero-padded to whole blocks and viewed as ``(MB, NB, bm * bn)`` (a view for 1 x n blocks that
    fit; ``fp8_kernels.reference.block_quantize`` groups its blocks the same way)."""
    (bm, bn), (m, n) = block, x.shape
    gm, gn = -(-m // bm), -(-n // bn)
    if gm * bm != m or gn * bn != n:
        x = torch.nn.functional.pad(x, (0, gn * bn - n, 0, gm * bm - m))
    return x.reshape(gm, bm, gn, bn).permute(0, 2, 1, 3).reshape(gm, gn, bm * bn)


def block_tensor_stats(
    x: torch.Tensor, q: BlockQuantized, fp8_dtype: torch.dtype, spec: BlockSpec, quality: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, block_row)`` of one quantization ``q`` of ``x`` (same orientation): ``row`` float64 the
    ``STAT_COLUMNS`` (the ``BASE_COLUMNS`` alone without ``quality``), ``block_row`` float64
    ``(BLOCK_WIDTH,)``: the ``BLOCK_COLUMNS`` then the scale exponent histogram. Device tensors only.

    The per-block quantities are ``fp8_kernels.reference.block_quantize.block_stats``'s (the tests hold them
    to it), computed here in one blocked view of ``x`` and ``q`` instead of the reference's separate
    passes."""
    xb = _blocked(x.detach().to(torch.float32), q.block)  # (MB, NB, block elements), zero-padded
    qb = _blocked(q.data.to(torch.float32), q.block)
    finite = torch.isfinite(xb)
    ax = xb.abs()
    amax_b = torch.nan_to_num(ax, nan=0.0, posinf=math.inf).amax(dim=-1).flatten()  # NaN ignored, Inf kept
    ax = torch.where(finite, ax, 0.0)
    codes, scale_b, scale_inv_b, at_limit, zero = _scale_and_limit(q, amax_b, fp8_dtype, spec, x.dtype)
    threshold, inclusive = overflow_threshold(fp8_dtype)
    a = ax * scale_b.unsqueeze(-1)  # |x * scale| of the finite values
    overflow_b = ((a >= threshold) if inclusive else (a > threshold)).sum(dim=-1)
    underflow_b = (finite & (xb != 0) & (qb == 0)).sum(dim=-1)
    big = ax.amax(dim=-1)
    small = torch.where(ax > 0, ax, math.inf).amin(dim=-1)
    quality_terms = None
    if quality:
        deq = torch.where(finite, qb * scale_inv_b.unsqueeze(-1), 0.0)  # q.dequantize() of the finite values
        err = deq - torch.where(finite, xb, 0.0)  # exact in float32 but where the cast saturated far out
        qa = qb.abs()
        quality_terms = (
            torch.linalg.vector_norm(ax, dtype=torch.float64).square(),  # float64 squares and sum
            torch.linalg.vector_norm(err, dtype=torch.float64).square(),
            torch.count_nonzero(finite & (qa > 0) & (qa < subnormal_threshold(fp8_dtype))),
        )
    return _assemble(
        x,
        q,
        amax_b,
        scale_b,
        at_limit,
        zero,
        overflow_b,
        underflow_b,
        torch.count_nonzero(~finite),
        big,
        small,
        codes,
        quality_terms,
    )


def _scale_and_limit(q: BlockQuantized, amax_b: torch.Tensor, fp8_dtype, spec: BlockSpec, input_dtype):
    """``(codes, scale_b, scale_inv_b, at_limit, zero)`` of ``q``'s blocks with amax ``amax_b`` (flat): the
    exponent histogram's bins, each block's scale and dequantization factor, the blocks with something to
    scale whose scale is at a limit, and the blocks with nothing to scale (amax 0: all zero, or NaN)."""
    empty = (amax_b == 0).reshape(q.scale_inv.shape)  # NaN is ignored by the amax: an all-NaN block is 0
    zero = torch.count_nonzero(empty)
    if q.scale_format == "e8m0":
        codes = q.scale_inv.to(torch.int64)
        scale_b, scale_inv_b = e8m0_to_scale(q.scale_inv), e8m0_to_scale_inv(q.scale_inv)
        at_limit = torch.count_nonzero(((codes == 0) | (codes == 254)) & ~empty)
    else:
        codes = (q.scale_inv.view(torch.int32) >> 23).to(torch.int64) & 0xFF
        scale_b = float32_block_scale(
            amax_b.reshape(q.scale_inv.shape),
            fp8_dtype,
            power_2_scale=spec.power_2_scale,
            amax_epsilon=spec.amax_epsilon,
            input_dtype=input_dtype,
        )
        scale_inv_b = q.scale_inv
        eff = torch.clamp(amax_b, min=spec.amax_epsilon)
        fell_back = (eff == 0) | ~torch.isfinite(eff)
        clamped = torch.isinf(torch.full_like(eff, torch.finfo(fp8_dtype).max) / eff)
        at_limit = torch.count_nonzero((fell_back | clamped) & ~empty.flatten())
    return codes, scale_b, scale_inv_b, at_limit, zero


def _assemble(
    x, q, amax_b, scale_b, at_limit, zero, overflow_b, underflow_b, nonfinite, big, small, codes, quality
):
    """The ``(row, block_row)`` of ``block_tensor_stats`` from per-block quantities (flat or blocked) and
    ``quality`` ``(sum_sq, err_sq, subnormal)`` or ``None``."""
    top = torch.argmax(amax_b).reshape(1)  # indexing with a 0-dim tensor would read it on the host
    amax, scale = amax_b.flatten().index_select(0, top), scale_b.flatten().index_select(0, top)
    overflow_b, underflow_b = overflow_b.flatten(), underflow_b.flatten()
    big, small = big.flatten(), small.flatten()
    drange = torch.where(big > 0, torch.log2(big.double() / small.double()), 0.0).to(torch.float32)
    numel = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    row = [amax, scale, overflow_b.sum(), underflow_b.sum(), nonfinite, numel]
    if quality is not None:
        row += [*quality, small.amin() if small.numel() else small.new_full((), math.inf)]
    row = torch.stack([v.to(torch.float64).reshape(()) for v in row])
    blocks = [
        torch.tensor(float(q.scale_inv.numel()), device=x.device),
        at_limit,
        torch.count_nonzero(overflow_b),
        torch.count_nonzero(underflow_b),
        drange.max() if drange.numel() else drange.new_zeros(()),
        zero,
    ]
    hist = torch.bincount(codes.flatten(), minlength=BLOCK_HIST_BINS).to(torch.float64)
    return row, torch.cat([torch.stack([v.to(torch.float64).reshape(()) for v in blocks]), hist])


def merge_block_row(stats: torch.Tensor, row: torch.Tensor, block_stats_row, new_block) -> None:
    """Merge one quantize call's ``row`` / ``new_block`` into the step's rows, in place, as
    ``fp8_protocol.stats.MERGE`` says (amax max with the scale that scaled it, min_abs min, block_range
    max, the rest summed)."""
    width = stats.shape[0]
    takes = (row[0] >= stats[0]) | torch.isnan(stats[0])
    stats[1].copy_(torch.where(takes, row[1], stats[1]))
    torch.fmax(stats[0], row[0], out=stats[0])
    stats[2 : min(width, 9)].add_(row[2 : min(width, 9)])
    if width == len(STAT_COLUMNS):
        torch.fmin(stats[9], row[9], out=stats[9])
    if block_stats_row is not None:
        keep = block_stats_row[_BLOCK_RANGE].clone()
        block_stats_row.add_(new_block)
        block_stats_row[_BLOCK_RANGE] = torch.fmax(keep, new_block[_BLOCK_RANGE])


def record_block_stats(x, q, fp8_dtype, spec, stats, block_stats_row) -> None:
    """Merge ``q``'s statistics, computed from ``x`` and ``q`` by ``block_tensor_stats`` (the path where no
    kernel recorded them: the CPU, the references), into the step's rows."""
    quality = stats.shape[0] == len(STAT_COLUMNS)
    row, block_row = block_tensor_stats(x, q, fp8_dtype, spec, quality=quality)
    merge_block_row(stats, row, block_stats_row, block_row)


# --- the autograd Function --------------------------------------------------------------------------------


class _BlockLinearFn(torch.autograd.Function):
    """The three GEMMs of a block-scaled layer (module docstring). ``specs``: input, weight, grad_output."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, k: int, record: bool):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        specs = state.block_specs[k]
        if specs[0].scale_format == "e8m0":
            name = state.layer_names[k] or "<root>"
            check_mxfp8_shape(x2, f"{name}.input")
            check_mxfp8_shape(weight, f"{name}.weight")
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ix, iw = 3 * k, 3 * k + 1
        qx, qxc = quantize_block_tensor(
            x2.detach(),
            state.dtypes[ix],
            specs[0],
            rowwise=True,
            columnwise=need_wgrad,
            **state.block_rows(ix, record),
        )
        qw, qwc = state.quantized_weight(  # once per step (FP8State.quantized_weight)
            k,
            weight,
            ("block", need_dgrad),
            record,
            lambda rec: quantize_block_tensor(
                weight.detach(),
                state.dtypes[iw],
                specs[1],
                rowwise=True,
                columnwise=need_dgrad,
                **state.block_rows(iw, rec),
            ),
        )
        out = block_gemm(qx, qw, "fprop")  # float32
        if bias is not None:
            out = out + bias.to(torch.float32)
        ctx.saved = (qxc, qwc)  # FP8 data and scales, not autograd inputs or outputs
        ctx.state, ctx.k, ctx.record = state, k, record
        ctx.shape, ctx.x_dtype, ctx.w_dtype = shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        qxc, qwc = ctx.saved
        ctx.saved = None
        state, k = ctx.state, ctx.k
        g2 = grad_output.reshape(-1, grad_output.shape[-1])
        ig = 3 * k + 2
        spec = state.block_specs[k][2]
        if spec.scale_format == "e8m0":
            check_mxfp8_shape(g2, f"{state.layer_names[k] or '<root>'}.grad_output")
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qg, qgc = quantize_block_tensor(
            g2.detach(),
            state.dtypes[ig],
            spec,
            rowwise=need_dgrad,
            columnwise=need_wgrad,
            **state.block_rows(ig, ctx.record),
        )
        if ctx.record:
            state.tracker.queue_end_of_backward(state.on_backward_end)
        grad_x = grad_w = grad_b = None
        if need_dgrad:
            grad_x = block_gemm(qg, qwc, "dgrad").to(ctx.x_dtype).reshape(ctx.shape)
        if need_wgrad:
            grad_w = block_gemm(qgc, qxc, "wgrad").to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None, None
