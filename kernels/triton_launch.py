"""Launch configuration shared by the Triton kernels: grid caps, block sizes and FP8 format constants.

The kernels are persistent: a capped grid of programs walks the tensor with a grid stride and each program
folds its share into the statistics row with a handful of atomics at the end, instead of one set per block
(thousands of same-address atomics would cost as much as the data pass itself on a large tensor).

On the CPU (``TRITON_INTERPRET=1``) the caps are tiny on purpose, so that small test tensors still run
several programs and several loop iterations per program, the same code paths a large tensor takes on a GPU.

Vectorised memory access: every kernel walks full blocks (tiles) with no mask and handles what is left in
one masked tail (edge tiles), so the main loop's loads and stores are 16-byte vectors whatever the size.
Sizes stay out of Triton's specialisation (``do_not_specialize``: no recompilation per size, and no
size-1 constant); where a row length must be known to be a multiple of 16 for its rows to start aligned
(the 2-D kernels), the launcher passes that divisor as a constexpr and the kernel rebuilds the size as
``(size // DIV) * DIV``, exact by construction and visible to the compiler, instead of a hint that could
be false (``divisor``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .quantize import fp8_max, overflow_threshold, underflow_threshold

__all__ = [
    "FLOAT32_MAX",
    "MAX_BLOCKS_PER_PROGRAM",
    "abs_bits",
    "amax_bits",
    "as_kernel_input",
    "block_1d",
    "block_scale_update",
    "divisor",
    "format_constants",
    "grid_cap",
    "load_f32",
    "persistent_grid",
    "tile_2d",
]

#: Largest finite float32: a scale that would be larger (tiny amax) is clamped to it.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def grid_cap(device: torch.device) -> int:
    """Programs to launch for a persistent kernel on ``device`` (more only for ``MAX_BLOCKS_PER_PROGRAM``)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return 4 * _sm_count(index)
    return 3


#: Most blocks (tiles) one program of the quantize kernels walks: its per-element counts are packed in
#: 10-bit fields (``triton_quantize``). 2**31 elements in blocks of 4096 need 513 programs for this.
MAX_BLOCKS_PER_PROGRAM = 2**10 - 1


def persistent_grid(n_blocks: int, device: torch.device) -> int:
    """Programs for ``n_blocks`` blocks: ``grid_cap`` (fewer for fewer blocks), raised where a program would
    otherwise walk more than ``MAX_BLOCKS_PER_PROGRAM`` of them (the grid stride gives each program at most
    ``ceil(n_blocks / programs)``)."""
    return max(1, min(n_blocks, max(grid_cap(device), triton.cdiv(n_blocks, MAX_BLOCKS_PER_PROGRAM))))


def block_1d(device: torch.device) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of the flat (1-D) kernels."""
    return (4096, 8) if device.type == "cuda" else (1024, 4)


def tile_2d(device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the tiled kernels (transposed output).

    Both sides a multiple of 16: a full tile's rows of ``q`` (along N) and of ``qt`` (along M) are then
    whole 16-byte FP8 vectors. On CUDA 16 elements per thread (the 16-byte FP8 vector), no register spills
    on sm_90 (about 120 registers, ``test_ptx.py``)."""
    return (128, 64, 16) if device.type == "cuda" else (32, 32, 4)


def block_scale_update(device: torch.device) -> tuple[int, int]:
    """``(BLOCK_L, BLOCK_N)`` of the scale update: history rows per chunk, tensors per program."""
    return (32, 128) if device.type == "cuda" else (8, 8)


def divisor(size: int) -> int:
    """16 where ``size`` is a multiple of 16 (rows of that length start 16-element aligned), else 1."""
    return 16 if size % 16 == 0 else 1


def format_constants(fp8_dtype: torch.dtype) -> dict[str, float | bool]:
    """The quantize kernels' constexprs for ``fp8_dtype``: ``FMAX``, ``UNDERFLOW`` (half the smallest
    subnormal), ``OVF_THRESHOLD`` and ``OVF_INCLUSIVE`` (``fp8_kernels.quantize.overflow_threshold``)."""
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    threshold, inclusive = overflow_threshold(fp8_dtype)
    return dict(
        FMAX=fp8_max(fp8_dtype),
        UNDERFLOW=underflow_threshold(fp8_dtype),
        OVF_THRESHOLD=threshold,
        OVF_INCLUSIVE=inclusive,
    )


def as_kernel_input(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(contiguous operand, is_bf16)``: bfloat16 goes in as its int16 bit patterns (see ``load_f32``)."""
    xc = x.contiguous()
    if xc.dtype == torch.bfloat16:
        return xc.view(torch.int16), True
    return xc, False


@triton.jit
def load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """Load as float32, masked-out elements 0 (``mask=None``: a full block, no mask). bfloat16 is widened
    from its bits (``bits << 16``): exact for every value on every backend, where Triton 3.9's interpreter
    flushes bfloat16 subnormals to zero in a plain conversion."""
    raw = tl.load(ptr + offs) if mask is None else tl.load(ptr + offs, mask=mask, other=0)
    if IS_BF16:
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def abs_bits(x):
    """``|x|``'s float32 bit pattern as an int32 (the sign bit cleared; integer order is float order)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def amax_bits(x):
    """``|x|``'s bits with NaN read as 0: the amax ignores NaN (``fmaxf``), Inf (0x7F800000) stays."""
    b = abs_bits(x)
    return tl.where(b > 0x7F800000, 0, b)
