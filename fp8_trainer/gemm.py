"""FP8 GEMMs: ``torch._scaled_mm`` on CUDA GPUs with FP8 tensor cores (sm_89+), emulation elsewhere.

The emulated GEMM multiplies the FP8 values (exact in float32) in float32 and applies both dequantization
scales to the product once: ``(qa @ qb) * (scale_inv_a * scale_inv_b)``, which is what a scaled FP8 GEMM with
float32 accumulation computes. ``torch._scaled_mm`` exists on the CPU too, but is thousands of times slower
than this, so it is never used there.

cuBLASLt's rules for a tensorwise-scaled FP8 GEMM (``torch._scaled_mm`` on sm_89 / sm_90), checked on the host
before every call by ``check_scaled_mm_args`` so that breaking one fails with a message, and fails on the CPU
in the tests that run this path there, instead of ``CUBLAS_STATUS_NOT_SUPPORTED`` on a GPU:

* ``a`` row-major ``(M, K)``, ``b`` column-major ``(K, N)`` (the "TN" layout); any other layout is an error,
  not a strided view, so an operand in the wrong layout costs a transposing copy;
* K and N multiples of 16; M may be anything (fprop and dgrad never pad; wgrad, whose K is the token count,
  zero-pads K where it is not a multiple of 16);
* FP8 operands, not both E5M2; 0-dim float32 scales whose pointers, like the operands', are 16-byte aligned
  (``fp8_kernels.aligned_scales`` keeps a model's scales that way);
* output bfloat16, float16 or float32 (no float64: that is computed in float32 and cast); a bias only with a
  bfloat16 / float16 output of its own dtype.

The forward GEMM gets both layouts for free; the backward GEMMs want the transposes of the saved operands,
which the FP8 ``Linear`` has the quantize pass write alongside ``q`` (see ``linear.py``), so that ``fp8_mm``
finds every operand already in its layout and copies nothing.

Accumulation: fprop uses cuBLASLt's fast accumulation (``use_fast_accum=True``), dgrad and wgrad the split
(more precise) accumulator, as Transformer Engine does (``_2X_ACC_FPROP = False``, ``_2X_ACC_DGRAD`` and
``_2X_ACC_WGRAD = True``): the gradients sum over many more products.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fp8_kernels import SCALE_ALIGN_BYTES, fp8_gpu

__all__ = [
    "check_once_per_layout",
    "check_scaled_mm_args",
    "fp8_mm",
    "gemm_operand",
    "is_plain_scaled_mm",
    "uses_scaled_mm",
]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def uses_scaled_mm(device: torch.device) -> bool:
    """True where the GEMMs run as real FP8 GEMMs (``torch._scaled_mm``)."""
    return fp8_gpu(device) and hasattr(torch, "_scaled_mm")


def gemm_operand(q: torch.Tensor) -> torch.Tensor:
    """The form in which a quantized tensor enters (and is saved for) GEMMs.

    Real FP8 GEMMs take the FP8 tensor; the emulation takes its float32 values, converted once here so that
    a tensor used by two GEMMs (weight: fprop and dgrad; input and grad_output) is converted only once.
    """
    return q if uses_scaled_mm(q.device) else q.to(torch.float32)


def check_scaled_mm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the argument where ``torch._scaled_mm(a, b, ...)`` breaks a cuBLASLt rule
    for a tensorwise FP8 GEMM (see the module docstring). Host metadata only: nothing is read on a device."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a, b: expected (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in _FP8:
            raise ValueError(f"{name}: expected an FP8 tensor (e4m3fn or e5m2), got {t.dtype}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise ValueError("a, b: cuBLASLt has no E5M2 x E5M2 FP8 GEMM")
    m, k = a.shape
    n = b.shape[1]
    if a.stride(1) != 1 or a.stride(0) < max(1, k):
        raise ValueError(f"a: expected row-major (M, K), got strides {a.stride()} for shape {tuple(a.shape)}")
    if b.stride(0) != 1 or b.stride(1) < max(1, k):
        raise ValueError(
            f"b: expected column-major (K, N) (a transposed row-major tensor), got strides {b.stride()} "
            f"for shape {tuple(b.shape)}"
        )
    if k % 16 or n % 16:
        raise ValueError(f"a, b: K ({k}) and N ({n}) must be multiples of 16; M ({m}) may be anything")
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if t.data_ptr() % SCALE_ALIGN_BYTES:
            raise ValueError(
                f"{name}: data pointer at byte offset {t.data_ptr() % SCALE_ALIGN_BYTES} from a 16-byte "
                "boundary; cuBLASLt needs 16-byte alignment (keep scales in fp8_kernels.aligned_scales)"
            )
    for name, t in (("a", a), ("b", b)):
        if max(t.stride()) % 16:
            raise ValueError(f"{name}: leading dimension {max(t.stride())} is not a multiple of 16 bytes")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"{name}: expected a float32 scalar tensor, got {s.dtype} {tuple(s.shape)}")
        if s.device != a.device:
            raise ValueError(f"{name}: on {s.device}, expected {a.device}")
    if b.device != a.device:
        raise ValueError(f"b: on {b.device}, expected {a.device}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")
    if bias is not None:
        if out_dtype == torch.float32:
            raise ValueError("bias: not supported with a float32 output")
        if bias.dtype != out_dtype or bias.shape != (n,):
            raise ValueError(f"bias: expected {out_dtype} ({n},), got {bias.dtype} {tuple(bias.shape)}")


def check_once_per_layout(
    checked: set, check: Callable[[], None], tensors: Sequence[torch.Tensor], other: tuple
) -> None:
    """``check()`` (which raises, naming the argument) for a hot path: in full once per layout, then only the
    ``tensors``' 16-byte alignment, which changes from call to call; the same errors either way. A layout is
    the tensors' shapes, strides, dtypes and devices plus ``other`` (the arguments that are not tensors);
    ``checked`` holds the layouts that passed, one set per kind of call."""
    key = (tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors), other)
    if key not in checked:
        check()
        checked.add(key)
    elif any(t.data_ptr() % SCALE_ALIGN_BYTES for t in tensors):
        check()  # raises, naming the argument


_CHECKED: set[tuple] = set()  # argument layouts ``check_scaled_mm_args`` passed


def _pad_k(t: torch.Tensor, kp: int) -> torch.Tensor:
    """Row-major ``t`` ``(R, K)`` zero-padded to ``(R, kp)`` in its own dtype (zeros add nothing)."""
    out = t.new_zeros((t.shape[0], kp))
    out[:, : t.shape[1]] = t
    return out


def _scaled_mm(
    a, scale_inv_a, b, scale_inv_b, out_dtype, bias, fast_accum: bool, check: bool = True
) -> torch.Tensor:
    """``torch._scaled_mm`` after the argument check, K padded where it is not a multiple of 16 (wgrad)."""
    k = a.shape[1]
    if k % 16:
        kp = k + (-k) % 16
        a = _pad_k(a.contiguous(), kp)
        b = _pad_k(b.t().contiguous(), kp).t()
    else:
        a = a if a.stride(1) == 1 else a.contiguous()
        b = b if b.stride(0) == 1 else b.t().contiguous().t()
    gemm_dtype = out_dtype if out_dtype in _OUT_DTYPES else torch.float32
    # the bias is added in the GEMM's epilogue where cuBLASLt takes one (a bfloat16 / float16 output)
    if bias is None or gemm_dtype == torch.float32:
        mm_bias = None
    else:
        mm_bias = bias if bias.dtype == gemm_dtype else bias.to(gemm_dtype)
    if check:
        check_once_per_layout(
            _CHECKED,
            lambda: check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, gemm_dtype, mm_bias),
            (a, b, scale_inv_a, scale_inv_b),
            (gemm_dtype, None if mm_bias is None else (mm_bias.dtype, mm_bias.shape)),
        )
    out = torch._scaled_mm(
        a,
        b,
        scale_a=scale_inv_a,
        scale_b=scale_inv_b,
        bias=mm_bias,
        out_dtype=gemm_dtype,
        use_fast_accum=fast_accum,
    )
    if bias is not None and mm_bias is None:
        out = out + bias.to(out.dtype)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def is_plain_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> bool:
    """Whether ``fp8_mm(a, _, b, _, out_dtype, bias)`` is exactly ``torch._scaled_mm(a, b, scale_a=...,
    scale_b=..., bias=bias, out_dtype=out_dtype, use_fast_accum=...)``: FP8 operands, not both E5M2, ``a``
    row-major and ``b`` column-major with K a multiple of 16 (no copy, no padding), an output dtype cuBLASLt
    writes, and a bias (if any) of that dtype that is not float32 (added in the GEMM's epilogue). A caller
    that makes operands of the same layouts at every call (the FP8 Linear's plan, ``linear_ops``) decides
    this once and then calls ``torch._scaled_mm`` itself, without ``fp8_mm``'s per-call branches."""
    return (
        a.dtype in _FP8
        and b.dtype in _FP8
        and not (a.dtype == b.dtype == torch.float8_e5m2)
        and a.shape[1] % 16 == 0
        and a.stride(1) == 1
        and b.stride(0) == 1
        and out_dtype in _OUT_DTYPES
        and (bias is None or (out_dtype != torch.float32 and bias.dtype == out_dtype))
    )


def fp8_mm(
    a: torch.Tensor,
    scale_inv_a: torch.Tensor,
    b: torch.Tensor,
    scale_inv_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    *,
    fast_accum: bool = False,
    check: bool = True,
) -> torch.Tensor:
    """``(a * scale_inv_a) @ (b * scale_inv_b) [+ bias]`` for 2-D GEMM operands (from ``gemm_operand``).

    The result is in ``out_dtype``. ``fast_accum`` selects cuBLASLt's fast FP8 accumulation on a GPU (fprop);
    the emulation always accumulates in float32. ``check=False`` skips the argument check of a real FP8 GEMM
    (``check_once_per_layout``), for a caller that made the same call with operands of the same layouts,
    freshly allocated (so aligned), before: the FP8 Linear, once per input shape (``linear_ops``).
    """
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        a, b = a.to(torch.float32), b.to(torch.float32)  # no E5M2 x E5M2 FP8 GEMM: emulate that one
    if a.dtype != torch.float32:
        return _scaled_mm(a, scale_inv_a, b, scale_inv_b, out_dtype, bias, fast_accum, check)
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
