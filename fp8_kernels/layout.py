"""Memory layout of per-tensor scales: every tensor's scale on its own 16-byte boundary.

cuBLASLt (behind ``torch._scaled_mm`` on a GPU) requires each scale pointer to be 16-byte aligned. A 0-dim
view ``scale_inv[i]`` of a packed float32 vector sits at byte offset ``4 * i`` and fails for ``i`` not a
multiple of 4 (``CUBLAS_STATUS_NOT_SUPPORTED``); the CPU ``_scaled_mm`` checks nothing, so only the layout
can prevent it. A model's scales are therefore kept as a ``(n,)`` float32 view with stride ``SCALE_STRIDE``
of an ``(n, SCALE_STRIDE)`` buffer: tensor ``i``'s scale is at byte ``16 * i`` of an allocation that the
caching allocator aligns far beyond 16 bytes, and ``scale[i]`` can go to a GEMM as it is, with no copy.
"""

from __future__ import annotations

import torch

__all__ = ["SCALE_ALIGN_BYTES", "SCALE_STRIDE", "aligned_scales", "as_aligned_scales", "is_aligned_scale"]

#: Alignment cuBLASLt requires of every scale pointer.
SCALE_ALIGN_BYTES = 16
#: float32 elements between consecutive tensors' scales (16 bytes).
SCALE_STRIDE = SCALE_ALIGN_BYTES // 4


def aligned_scales(values: torch.Tensor | int, device=None) -> torch.Tensor:
    """A ``(n,)`` float32 vector whose elements each start a 16-byte block (stride ``SCALE_STRIDE``).

    Args:
        values: the ``(n,)`` values to copy in, or ``n`` for an uninitialised vector.
        device: where to allocate (default: ``values``' device, else the CPU).
    """
    if isinstance(values, int):
        n, src = values, None
    else:
        if values.dim() != 1:
            raise ValueError(f"values: expected a (n,) tensor, got shape {tuple(values.shape)}")
        n, src = values.shape[0], values
        device = device if device is not None else values.device
    buf = torch.empty(n, SCALE_STRIDE, dtype=torch.float32, device=device)
    out = buf[:, 0]
    if src is not None:
        out.copy_(src)
    return out


def is_aligned_scale(t: torch.Tensor) -> bool:
    """True where ``t``'s data pointer is 16-byte aligned (what cuBLASLt needs of a scale)."""
    return t.data_ptr() % SCALE_ALIGN_BYTES == 0


def as_aligned_scales(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where it already has the ``aligned_scales`` layout, else an aligned copy."""
    strided = t.dim() == 1 and (t.numel() <= 1 or t.stride(0) == SCALE_STRIDE)
    if strided and t.dtype == torch.float32 and is_aligned_scale(t):
        return t
    return aligned_scales(t.to(torch.float32))
