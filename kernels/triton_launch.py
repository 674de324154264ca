"""Launch configuration shared by the Triton kernels: grid caps, block sizes and FP8 format constants.

The kernels are persistent: a capped grid of programs walks the tensor with a grid stride and each program
folds its share into the statistics row with a handful of atomics at the end, instead of one set per block
(thousands of same-address atomics would cost as much as the data pass itself on a large tensor).

On the CPU (``TRITON_INTERPRET=1``) the caps are tiny on purpose, so that small test tensors still run
several programs and several loop iterations per program, the same code paths a large tensor takes on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = [
    "FLOAT32_MAX",
    "as_kernel_input",
    "block_1d",
    "format_constants",
    "grid_cap",
    "load_f32",
    "tile_2d",
]

#: Largest finite float32: a scale that would be larger (tiny amax) is clamped to it.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def grid_cap(device: torch.device) -> int:
    """Most programs to launch for a persistent kernel on ``device``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return 4 * _sm_count(index)
    return 3


def block_1d(device: torch.device) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of the flat (1-D) kernels."""
    return (4096, 8) if device.type == "cuda" else (1024, 4)


def tile_2d(device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the tiled kernels (transposed output)."""
    return (64, 64, 4) if device.type == "cuda" else (32, 32, 4)


def format_constants(fp8_dtype: torch.dtype) -> tuple[float, float]:
    """``(fp8_max, underflow_threshold)`` of ``fp8_dtype``, exact powers-of-two arithmetic."""
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    fi = torch.finfo(fp8_dtype)
    return float(fi.max), float(fi.smallest_normal) * float(fi.eps) / 2


def as_kernel_input(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(contiguous operand, is_bf16)``: bfloat16 goes in as its int16 bit patterns (see ``load_f32``)."""
    xc = x.contiguous()
    if xc.dtype == torch.bfloat16:
        return xc.view(torch.int16), True
    return xc, False


@triton.jit
def load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """Load as float32. bfloat16 is widened from its bits (``bits << 16``): exact for every value on every
    backend, where Triton 3.9's interpreter flushes bfloat16 subnormals to zero in a plain conversion."""
    if IS_BF16:
        raw = tl.load(ptr + offs, mask=mask, other=0)
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
