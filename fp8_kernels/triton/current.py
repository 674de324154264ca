"""Current (just-in-time) scaling in Triton: an amax pass, then the fused quantize pass.

The scale of current scaling depends on the amax of the very tensor being quantized, so it cannot be known
before a full pass over it: pass 1 reduces ``max |x|`` (NaN elements ignored, as Transformer Engine's
``fmaxf``: one NaN does not decide the whole tensor's scale), each of its programs writing its own partial
maximum (the float32 bits of ``|x|``, as int32) to a slot of its own; pass 2 is the fused quantize kernel of
``triton.quantize``, which reduces those partial maxima (a few hundred words, read from L2 by every program)
and derives ``scale = FP8_MAX / amax`` itself (clamped to the float32 maximum, 1 for a zero or non-finite
amax, optionally rounded down to a power of two, as ``fp8_trainer.scaling.current_scale``), and records the
same statistics as delayed scaling; asked for it, it also writes the scale's reciprocal, the GEMM's
``scale_inv``, so that no launch of its own computes it. The scale, ``scale_inv`` and the partial maxima
share one uninitialised buffer (the scale and ``scale_inv`` each 16-byte aligned): every slot is written
before it is read, so nothing fills it first, and a call is two launches. Nothing is read on the host in
between. The transposed variant writes ``q.t().contiguous()`` in the same quantize pass, as
``triton.quantize`` does for delayed scaling.

``tensor_amax_triton``, the amax alone as a 0-dim tensor, reduces into one zeroed word with an atomic max
instead (the same kernel, ``PER_PROGRAM`` off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.quantize import check_dbias_operand
from .launch import PreparedLaunch, amax_bits, as_kernel_input, block_1d, cdiv, grid_cap, launch, load_f32
from .quantize import MAX_NUMEL, launch_quantize, prepare_quantize

__all__ = ["amax_pass", "quantize_current_transposed_triton", "quantize_current_triton", "tensor_amax_triton"]


@triton.jit(do_not_specialize=["n"])
def _amax_kernel(x_ptr, out_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    """``max |x|`` over the bit patterns, NaN read as 0 (ignored on every backend): full blocks unmasked
    (vector loads), then one masked tail block. ``PER_PROGRAM``: each program stores its own maximum's bits
    at ``out[program]`` (int32); otherwise ``out = max(out, max |x|)``, an atomic max into a 0-dim float32."""
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
    if PER_PROGRAM:
        tl.store(out_ptr + pid, tl.max(acc, axis=0))
    else:
        tl.atomic_max(out_ptr.to(tl.pointer_type(tl.int32)), tl.max(acc, axis=0))


def _amax_launch(x: torch.Tensor) -> tuple[int, tuple, dict]:
    """``(programs, runtime arguments after out, constexprs and options)`` of the amax kernel over ``x``."""
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"x: {x.numel()} elements exceed the Triton kernel's limit of {MAX_NUMEL}")
    xc, is_bf16 = as_kernel_input(x)
    n = xc.numel()
    block, warps = block_1d(x.device)
    grid = max(1, min(cdiv(n, block), grid_cap(x.device)))
    return grid, (xc, n), dict(IS_BF16=is_bf16, BLOCK=block, num_warps=warps)


def tensor_amax_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``tensor_amax_reference``: ``max |x|`` as a float32 0-dim tensor, NaN ignored.
    ``out``: a zeroed float32 0-dim tensor to reduce into (and return), instead of a fresh one."""
    grid, (xc, n), kwargs = _amax_launch(x)
    if out is None:
        out = torch.zeros((), dtype=torch.float32, device=x.device)
    launch(_amax_kernel, grid, xc, out, n, PER_PROGRAM=False, **kwargs)
    return out


def amax_pass(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 of a call: ``(amax_parts, scale_out)``, the partial maxima of ``|x|``, one per program of the
    amax kernel (int32 bits, ``launch_quantize``'s ``amax_parts``), and the 8 words the quantize pass writes
    its scale (element 0) and ``scale_inv`` (element 4) to, each 16-byte aligned as cuBLASLt wants the GEMM's
    scale pointers. One allocation, no fill: the amax kernel writes every partial, the quantize pass both
    scalars."""
    grid, (xc, n), kwargs = _amax_launch(x)
    buf = torch.empty(8 + grid, dtype=torch.float32, device=x.device)
    parts = buf[8:].view(torch.int32)
    launch(_amax_kernel, grid, xc, parts, n, PER_PROGRAM=True, **kwargs)
    return parts, buf[:8]


def quantize_current_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    power_2_scale: bool = False,
    precast: torch.Tensor | None = None,
    return_scale_inv: bool = False,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Current scaling in two passes: ``(q, scale, stats_row)``; ``scale`` is a float32 0-dim tensor.

    ``power_2_scale``: round the scale down to a power of two. ``precast`` as in
    ``triton.quantize.launch_quantize`` (the clamped scaled values, for tests). ``return_scale_inv``: also
    return ``1 / scale`` (``(q, scale, scale_inv, stats_row)``), written by the quantize pass (no launch of
    its own), 16-byte aligned. ``dbias``: the column sums of a 2-D ``x`` appended, taken by the quantize
    pass (still two launches).
    """
    if dbias:  # before the amax pass: nothing launched for a bad operand
        check_dbias_operand(x)
    parts, scale_out = amax_pass(x)
    q, _, row, scale, *column_sums = launch_quantize(
        x,
        None,
        fp8_dtype,
        stats,
        amax_parts=parts,
        scale_from_amax=True,
        precast=precast,
        power_2_scale=power_2_scale,
        scale_out=scale_out,
        dbias=dbias,
    )
    out = (q, scale, scale_out[4], row) if return_scale_inv else (q, scale, row)
    return (*out, *column_sums)


def quantize_current_transposed_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    power_2_scale: bool = False,
    precast: torch.Tensor | None = None,
    return_scale_inv: bool = False,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """As ``quantize_current_triton`` for a 2-D ``x``, the quantize pass also writing the transposed FP8
    tensor: ``(q, qt, scale, stats_row)`` with ``qt == q.t().contiguous()`` (``(q, qt, scale, scale_inv,
    stats_row)`` with ``return_scale_inv``; the column sums appended with ``dbias``)."""
    if dbias:  # before the amax pass: nothing launched for a bad operand
        check_dbias_operand(x)
    if x.dim() != 2:
        raise ValueError(f"x: the transposed output needs a 2-D tensor, got shape {tuple(x.shape)}")
    parts, scale_out = amax_pass(x)
    q, qt, row, scale, *column_sums = launch_quantize(
        x,
        None,
        fp8_dtype,
        stats,
        amax_parts=parts,
        scale_from_amax=True,
        precast=precast,
        transpose=True,
        power_2_scale=power_2_scale,
        scale_out=scale_out,
        dbias=dbias,
    )
    out = (q, qt, scale, scale_out[4], row) if return_scale_inv else (q, qt, scale, row)
    return (*out, *column_sums)


def _prepare_current(transpose: bool):
    def prepare(x, fp8_dtype, row, scale=None, *, dbias: bool = False, power_2_scale: bool = False):
        grid, _, kwargs = _amax_launch(x)
        amax = (PreparedLaunch(_amax_kernel, grid, dict(kwargs, PER_PROGRAM=True)), grid)
        return prepare_quantize(
            x, fp8_dtype, row, None, transpose=transpose, dbias=dbias, amax=amax, power_2_scale=power_2_scale
        )

    return prepare


# the dispatch table's prepared calls (fp8_kernels.dispatch.prepare_quantize)
quantize_current_triton.prepare = _prepare_current(False)
quantize_current_transposed_triton.prepare = _prepare_current(True)
