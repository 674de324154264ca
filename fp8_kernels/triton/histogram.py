"""Exponent histogram in Triton (layout and meaning: ``fp8_kernels.reference.histogram``).

Each element's bin comes from its float32 bit pattern with integer operations only: the exponent field for
normal numbers, and for subnormals the position of the mantissa's leading one, found by converting the
mantissa (an integer below 2**23, exact in float32) to float and reading that exponent. No float arithmetic
on subnormals, so flush-to-zero settings cannot change a bin. Each program keeps a private histogram over
its grid-stride share of full blocks (unmasked: vector loads) and the one masked tail block, and adds it to
the output once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.histogram import EXP_MIN, HIST_BINS
from .launch import as_kernel_input, block_1d, cdiv, grid_cap, launch, load_f32
from .quantize import MAX_NUMEL

__all__ = ["exponent_histogram_triton"]

_BINS_POW2 = triton.next_power_of_2(HIST_BINS)  # tl.histogram wants a power of two


@triton.jit
def _bins(x_ptr, offs, mask, EXP_MIN: tl.constexpr, IS_BF16: tl.constexpr):
    """The bin of each element (layout: ``fp8_kernels.reference.histogram``)."""
    bits = load_f32(x_ptr, offs, mask, IS_BF16).to(tl.int32, bitcast=True)
    bits = bits & 0x7FFFFFFF
    field = bits >> 23
    mant = bits & 0x7FFFFF
    lead = (mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127  # floor(log2(mant)), mant > 0
    e = tl.where(field == 0, lead - 149, field - 127)
    return tl.where(bits == 0, 0, tl.where(field == 255, 1, 2 + e - EXP_MIN))


@triton.jit(do_not_specialize=["n"])
def _histogram_kernel(
    x_ptr,
    out_ptr,
    n,
    EXP_MIN: tl.constexpr,
    BINS: tl.constexpr,
    BINS_POW2: tl.constexpr,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BINS_POW2], dtype=tl.int32)
    n_full = n // BLOCK
    for b in range(pid, n_full, nprog):
        acc += tl.histogram(_bins(x_ptr, b * BLOCK + tl.arange(0, BLOCK), None, EXP_MIN, IS_BF16), BINS_POW2)
    tail = n_full * BLOCK
    if (pid == n_full % nprog) & (tail < n):
        offs = tail + tl.arange(0, BLOCK)
        mask = offs < n
        acc += tl.histogram(_bins(x_ptr, offs, mask, EXP_MIN, IS_BF16), BINS_POW2, mask=mask)
    bins = tl.arange(0, BINS_POW2)
    tl.atomic_add(out_ptr + bins, acc.to(tl.int64), mask=bins < BINS)


def exponent_histogram_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``exponent_histogram_reference``: ``HIST_BINS`` int64 counts on ``x``'s device."""
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"x: {x.numel()} elements exceed the Triton kernel's limit of {MAX_NUMEL}")
    xc, is_bf16 = as_kernel_input(x.detach())
    out = torch.zeros(HIST_BINS, dtype=torch.int64, device=x.device)
    n = xc.numel()
    block, warps = block_1d(x.device)
    grid = max(1, min(cdiv(n, block), grid_cap(x.device)))
    launch(
        _histogram_kernel,
        grid,
        xc,
        out,
        n,
        EXP_MIN=EXP_MIN,
        BINS=HIST_BINS,
        BINS_POW2=_BINS_POW2,
        IS_BF16=is_bf16,
        BLOCK=block,
        num_warps=warps,
    )
    return out
