"""Current (just-in-time) scaling in Triton: an amax pass, then the fused quantize pass.

The scale of current scaling depends on the amax of the very tensor being quantized, so it cannot be known
before a full pass over it: pass 1 reduces ``max |x|`` (NaN elements ignored, as Transformer Engine's
``fmaxf``: one NaN does not decide the whole tensor's scale) into a 0-dim float32 on the device; pass 2 is
the fused quantize kernel of ``triton_quantize``, which derives ``scale = FP8_MAX / amax`` itself (clamped
to the float32 maximum, 1 for a zero or non-finite amax, optionally rounded down to a power of two, as
``fp8_trainer.scaling.current_scale``) and records the same statistics as delayed scaling; asked for it, it
also writes the scale's reciprocal, the GEMM's ``scale_inv``, so that no launch of its own computes it. The
amax accumulator, the scale and ``scale_inv`` share one zeroed buffer, each 16-byte aligned. Nothing is read
on the host in between. The transposed variant writes ``q.t().contiguous()`` in the same quantize pass, as
``triton_quantize`` does for delayed scaling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import amax_bits, as_kernel_input, block_1d, grid_cap, launch, load_f32
from .triton_quantize import MAX_NUMEL, launch_quantize

__all__ = ["quantize_current_transposed_triton", "quantize_current_triton", "tensor_amax_triton"]


@triton.jit(do_not_specialize=["n"])
def _amax_kernel(x_ptr, out_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """``out = max(out, max |x|)`` over the bit patterns, NaN read as 0 (ignored on every backend): full
    blocks unmasked (vector loads), then one masked tail block."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    n_full = n // BLOCK
    for b in range(pid, n_full, nprog):
        acc = tl.maximum(acc, amax_bits(load_f32(x_ptr, b * BLOCK + tl.arange(0, BLOCK), None, IS_BF16)))
    tail = n_full * BLOCK
    if (pid == n_full % nprog) & (tail < n):
        offs = tail + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, amax_bits(load_f32(x_ptr, offs, offs < n, IS_BF16)))
    tl.atomic_max(out_ptr.to(tl.pointer_type(tl.int32)), tl.max(acc, axis=0))


def tensor_amax_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``tensor_amax_reference``: ``max |x|`` as a float32 0-dim tensor, NaN ignored.
    ``out``: a zeroed float32 0-dim tensor to reduce into (and return), instead of a fresh one."""
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"x: {x.numel()} elements exceed the Triton kernel's limit of {MAX_NUMEL}")
    xc, is_bf16 = as_kernel_input(x)
    if out is None:
        out = torch.zeros((), dtype=torch.float32, device=x.device)
    n = xc.numel()
    block, warps = block_1d(x.device)
    grid = max(1, min(triton.cdiv(n, block), grid_cap(x.device)))
    launch(_amax_kernel, grid, xc, out, n, IS_BF16=is_bf16, BLOCK=block, num_warps=warps)
    return out


def _scalars(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One zeroed float32 buffer for a call's scalars, each 16 bytes from the next (the GEMM reads the
    reciprocal, and cuBLASLt wants 16-byte-aligned scale pointers): the amax pass's 0-dim accumulator
    (element 0), and the quantize pass's ``scale_out`` (elements 4 on: its scale, then its reciprocal at 8).
    One allocation and one fill launch for all three."""
    buf = torch.zeros(12, dtype=torch.float32, device=device)
    return buf[0], buf[4:]


def quantize_current_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    power_2_scale: bool = False,
    precast: torch.Tensor | None = None,
    return_scale_inv: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Current scaling in two passes: ``(q, scale, stats_row)``; ``scale`` is a float32 0-dim tensor.

    ``power_2_scale``: round the scale down to a power of two. ``precast`` as in
    ``triton_quantize.launch_quantize`` (the clamped scaled values, for tests). ``return_scale_inv``: also
    return ``1 / scale`` (``(q, scale, scale_inv, stats_row)``), written by the quantize pass (no launch of
    its own), 16-byte aligned.
    """
    amax, scale_out = _scalars(x.device)
    tensor_amax_triton(x, out=amax)
    q, _, row, scale = launch_quantize(
        x, None, fp8_dtype, stats, amax=amax, scale_from_amax=True, precast=precast,
        power_2_scale=power_2_scale, scale_out=scale_out,
    )  # fmt: skip
    return (q, scale, scale_out[4], row) if return_scale_inv else (q, scale, row)


def quantize_current_transposed_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    power_2_scale: bool = False,
    precast: torch.Tensor | None = None,
    return_scale_inv: bool = False,
) -> tuple[torch.Tensor, ...]:
    """As ``quantize_current_triton`` for a 2-D ``x``, the quantize pass also writing the transposed FP8
    tensor: ``(q, qt, scale, stats_row)`` with ``qt == q.t().contiguous()`` (``(q, qt, scale, scale_inv,
    stats_row)`` with ``return_scale_inv``)."""
    if x.dim() != 2:  # before the amax pass: nothing launched for a bad operand
        raise ValueError(f"x: the transposed output needs a 2-D tensor, got shape {tuple(x.shape)}")
    amax, scale_out = _scalars(x.device)
    tensor_amax_triton(x, out=amax)
    q, qt, row, scale = launch_quantize(
        x, None, fp8_dtype, stats, amax=amax, scale_from_amax=True, precast=precast, transpose=True,
        power_2_scale=power_2_scale, scale_out=scale_out,
    )  # fmt: skip
    return (q, qt, scale, scale_out[4], row) if return_scale_inv else (q, qt, scale, row)
