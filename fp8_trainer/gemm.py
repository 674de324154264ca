"""FP8 GEMMs: ``torch._scaled_mm`` on CUDA GPUs with FP8 tensor cores (sm_89+), emulation elsewhere.

The emulated GEMM multiplies the FP8 values (exact in float32) in float32 and applies both dequantization
scales to the product once: ``(qa @ qb) * (scale_inv_a * scale_inv_b)``, which is what a scaled FP8 GEMM with
float32 accumulation computes. ``torch._scaled_mm`` exists on the CPU too, but is thousands of times slower
than this, so it is never used there.

Layouts: on the GPUs this targets (sm_89, sm_90), ``torch._scaled_mm(a, b)`` accepts only a row-major ``a``
and a column-major ``b`` (cuBLASLt's "TN" FP8 GEMM); any other layout is an error, not a strided view, so
an operand in the wrong layout costs a transposing copy (a full read and write of the FP8 tensor). The
forward GEMM gets both layouts for free; the backward GEMMs want the transposes of the saved operands,
which the FP8 ``Linear`` has the quantize pass write alongside ``q`` (see ``linear.py``), so that ``fp8_mm``
finds every operand already in its layout and copies nothing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["fp8_mm", "gemm_operand", "uses_scaled_mm"]


@functools.cache
def _device_has_fp8_mm(index: int) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(index) >= (8, 9)


def uses_scaled_mm(device: torch.device) -> bool:
    """True where the GEMMs run as real FP8 GEMMs (``torch._scaled_mm``)."""
    if device.type != "cuda":
        return False
    return _device_has_fp8_mm(device.index if device.index is not None else torch.cuda.current_device())


def gemm_operand(q: torch.Tensor) -> torch.Tensor:
    """The form in which a quantized tensor enters (and is saved for) GEMMs.

    Real FP8 GEMMs take the FP8 tensor; the emulation takes its float32 values, converted once here so that
    a tensor used by two GEMMs (weight: fprop and dgrad; input and grad_output) is converted only once.
    """
    return q if uses_scaled_mm(q.device) else q.to(torch.float32)


def _scaled_mm_operand(t: torch.Tensor, column_major: bool) -> torch.Tensor:
    """``t`` zero-padded to multiples of 16 in both dims, in the layout ``_scaled_mm`` wants; returned as
    is when it needs neither padding nor a layout change (zeros add nothing to the product)."""
    if column_major:
        return _scaled_mm_operand(t.t(), False).t()
    pad_rows, pad_cols = (-t.shape[0]) % 16, (-t.shape[1]) % 16
    if pad_rows == 0 and pad_cols == 0:
        return t.contiguous()
    # the padded copy is written row-major directly, whatever the layout of t: one copy, not two
    return F.pad(t.to(torch.float32), (0, pad_cols, 0, pad_rows)).to(t.dtype).contiguous()


def fp8_mm(
    a: torch.Tensor,
    scale_inv_a: torch.Tensor,
    b: torch.Tensor,
    scale_inv_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a * scale_inv_a) @ (b * scale_inv_b) [+ bias]`` for 2-D GEMM operands (from ``gemm_operand``).

    Accumulates in float32; the result is in ``out_dtype``.
    """
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        a, b = a.to(torch.float32), b.to(torch.float32)  # no E5M2 x E5M2 FP8 GEMM: emulate that one
    if a.dtype == torch.float32:
        # Apply scale_inv_a * scale_inv_b where it costs least: to the smallest of a, b and the output
        # (the weight, usually), and fold the bias into the GEMM.
        s = scale_inv_a * scale_inv_b
        m, n = a.shape[0], b.shape[1]
        smallest = min(a.numel(), b.numel(), m * n)
        bias32 = None if bias is None else bias.to(torch.float32)
        if smallest == m * n:
            out = torch.mm(a, b)
            out = out.mul_(s) if bias32 is None else torch.addcmul(bias32, out, s)
        else:
            if smallest == b.numel():
                b = b * s
            else:
                a = a * s
            out = torch.mm(a, b) if bias32 is None else torch.addmm(bias32, a, b)
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    # _scaled_mm wants a row-major, b column-major, every dimension a multiple of 16. The weight dims are
    # (checked at conversion); the token dim may not be, so it is zero-padded.
    m = a.shape[0]
    a = _scaled_mm_operand(a, column_major=False)
    b = _scaled_mm_operand(b, column_major=True)
    out = torch._scaled_mm(
        a, b, scale_a=scale_inv_a.float(), scale_b=scale_inv_b.float(), out_dtype=out_dtype
    )
    out = out[:m] if out.shape[0] != m else out
    return out if bias is None else out + bias.to(out_dtype)
