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

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from ..device import fp8_gpu
from ..reference.quantize import fp8_max, overflow_threshold, subnormal_threshold, underflow_threshold

__all__ = [
    "FLOAT32_MAX",
    "PreparedLaunch",
    "launch",
    "launch_key",
    "LANE",
    "MAX_BLOCKS_PER_PROGRAM",
    "PROGRAMS_PER_SM",
    "abs_bits",
    "amax_bits",
    "as_kernel_input",
    "block_1d",
    "block_scale_update",
    "divisor",
    "format_constants",
    "grid_2d",
    "grid_cap",
    "load_f32",
    "persistent_grid",
    "pipeline_stages",
    "prefetch",
    "saturating_cast",
    "tile_2d",
    "to_f32",
]

#: Largest finite float32: a scale that would be larger (tiny amax) is clamped to it.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


#: Programs per SM of a persistent kernel's grid on CUDA (``grid_cap``); how many of them an SM runs at once
#: depends on their registers and shared memory (``bench/sass.py``)
PROGRAMS_PER_SM = 4


def grid_cap(device: torch.device) -> int:
    """Programs to launch for a persistent kernel on ``device`` (more only for ``MAX_BLOCKS_PER_PROGRAM``)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return PROGRAMS_PER_SM * _sm_count(index)
    return 3


#: Consecutive elements (along a block's or tile's last axis) whose statistics the quantize kernels fold
#: into one accumulator slot per block (``triton.quantize._runs``): a run stays in one thread's registers,
#: so the accumulators are 8 times narrower than a block at no extra instruction and no cross-thread work.
_LANE = 8
LANE = tl.constexpr(_LANE)

#: Most blocks (tiles) one program of the quantize kernels walks: a slot's counts are packed in 8-bit
#: fields, each at most ``LANE`` per block (``triton.quantize``). 2**31 elements in blocks of 4096 need
#: 16913 programs for this.
MAX_BLOCKS_PER_PROGRAM = (2**8 - 1) // _LANE


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launchers' host arithmetic: ``triton.cdiv`` is a constexpr function whose host
    call costs about 2 us (Triton 3.9), several per quantize call."""
    return -(-a // b)


def persistent_grid(n_blocks: int, device: torch.device) -> int:
    """Programs for ``n_blocks`` blocks: ``grid_cap`` (fewer for fewer blocks), raised where a program would
    otherwise walk more than ``MAX_BLOCKS_PER_PROGRAM`` of them (the grid stride gives each program at most
    ``ceil(n_blocks / programs)``)."""
    return max(1, min(n_blocks, max(grid_cap(device), cdiv(n_blocks, MAX_BLOCKS_PER_PROGRAM))))


def grid_2d(tiles_m: int, tiles_n: int, device: torch.device) -> tuple[int, int]:
    """``(PM, PN)``: the tiled kernels' programs as a ``PM x PN`` grid, program ``(pm, pn)`` taking tile
    columns ``pn, pn + PN, ...`` and in each the tile rows ``pm, pm + PM, ...`` (``triton.quantize``). About
    ``grid_cap`` programs, one column group per tile column where they suffice, and never more than
    ``MAX_BLOCKS_PER_PROGRAM`` tiles for one program."""
    cap = grid_cap(device)
    pn = max(1, min(tiles_n, cap))
    if cdiv(tiles_n, pn) > MAX_BLOCKS_PER_PROGRAM:
        pn = cdiv(tiles_n, MAX_BLOCKS_PER_PROGRAM)
    rows = MAX_BLOCKS_PER_PROGRAM // cdiv(tiles_n, pn)  # tile rows one program may take
    pm = max(1, min(tiles_m, max(cap // pn, cdiv(tiles_m, rows))))
    return pm, pn


def block_1d(device: torch.device) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of the flat (1-D) kernels."""
    return (4096, 8) if device.type == "cuda" else (1024, 4)


def tile_2d(device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the tiled kernels (transposed output, column sums).

    Both sides a multiple of 16: a full tile's rows of ``q`` (along N) and of ``qt`` (along M) are then
    whole 16-byte FP8 vectors. On CUDA 64 x 64 for 4 warps: a thread takes rows ``2i`` and ``2i + 1`` of
    16 columns (``triton.quantize._pair_offsets``: 16-byte FP8 vectors for ``q``, 16-bit words for the
    transpose); sm_90 runs 3 or 4 such programs per SM with no spills (``test_ptx.py``, ``bench/sass.py``)."""
    return (64, 64, 4) if device.type == "cuda" else (32, 32, 4)


def saturating_cast(device: torch.device) -> bool:
    """Whether Triton's float32 -> FP8 cast on ``device`` saturates by itself, so the kernels may skip their
    clamp and arithmetic rounding (``triton.quantize._to_fp8``): on NVIDIA GPUs from sm_89 it is one
    ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` per pair (PTX ISA: values beyond the largest finite value and
    infinities become it, with their sign; NaN stays NaN), which gives the bits of the clamp-then-cast of
    ``quantize_with_stats_reference`` (the GPU kernel tests check the bits; ``test_ptx.py`` that the sm_90
    build then has the cast alone). Not under the interpreter (CPU tensors), whose cast rounds some values
    wrongly, nor on ROCm or older GPUs."""
    return torch.version.hip is None and fp8_gpu(device)


def prefetch(device: torch.device) -> bool:
    """Whether the quantize kernels load a program's next block (tile) before working on the current one,
    so that two are in flight per program: a program's loads would otherwise wait alone for memory (one
    128 x 64 tile per SM in flight is about a third of what an H200 needs to stream at full bandwidth).
    On every device, so that the interpreter tests run the code the GPU runs; ``bench/kernel_configs.py``
    measures both forms side by side. Where it is off, ``pipeline_stages`` says how the main loop keeps
    loads in flight instead."""
    return True


def pipeline_stages(device: torch.device) -> int:
    """``num_stages`` of the quantize kernels' main loop (``tl.range``) where ``prefetch`` is off: Triton's
    software pipeline. With 3 or 4 stages the sm_90 build turns the loop's loads into asynchronous copies into
    shared memory (``cp.async``, 16 bytes each; ``test_ptx.py``), issued ``stages - 1`` blocks (tiles) ahead,
    which hold no registers, where the register prefetch holds the next block in registers, and registers
    limit how many programs an SM runs (``bench/sass.py``: registers, programs per SM, bytes in flight).
    With 2, Triton 3.9 leaves the 2-D kernel's loop unpipelined; 1 is the plain loop. The interpreter runs
    every loop plainly. ``bench/kernels.py`` (``triton-pipe`` rows) and ``bench/kernel_configs.py`` time this
    form beside the shipped one."""
    return 4


def block_scale_update(device: torch.device) -> tuple[int, int]:
    """``(BLOCK_L, BLOCK_N)`` of the scale update: history rows per chunk, tensors per program."""
    return (32, 128) if device.type == "cuda" else (8, 8)


def divisor(size: int) -> int:
    """16 where ``size`` is a multiple of 16 (rows of that length start 16-element aligned), else 1."""
    return 16 if size % 16 == 0 else 1


@functools.cache
def format_constants(fp8_dtype: torch.dtype) -> dict[str, float | bool]:
    """The quantize kernels' constexprs for ``fp8_dtype``: ``FMAX``, ``UNDERFLOW`` (half the smallest
    subnormal), ``OVF_THRESHOLD`` and ``OVF_INCLUSIVE`` (``reference.quantize.overflow_threshold``), and
    for the quality statistics ``SUBNORMAL_TOP`` (``subnormal_threshold``), ``MIN_NORMAL``, ``SUB_MAGIC``
    (the smallest subnormal times 2**23) and ``DROP`` (float32 mantissa bits the format lacks).
    Computed once per dtype (the dict is shared: callers unpack it, never change it)."""
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    threshold, inclusive = overflow_threshold(fp8_dtype)
    fi = torch.finfo(fp8_dtype)
    return dict(
        FMAX=fp8_max(fp8_dtype),
        UNDERFLOW=underflow_threshold(fp8_dtype),
        OVF_THRESHOLD=threshold,
        OVF_INCLUSIVE=inclusive,
        SUBNORMAL_TOP=subnormal_threshold(fp8_dtype),
        MIN_NORMAL=float(fi.smallest_normal),
        SUB_MAGIC=float(fi.smallest_normal) * float(fi.eps) * 2.0**23,
        DROP=23 - round(-math.log2(float(fi.eps))),
    )


def as_kernel_input(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(contiguous operand, is_bf16)``: bfloat16 goes in as its int16 bit patterns (see ``load_f32``)."""
    xc = x.contiguous()
    if xc.dtype == torch.bfloat16:
        return xc.view(torch.int16), True
    return xc, False


#: Every launch asks for floating-point fusion (a multiply and a dependent add as one FMA) explicitly, rather
#: than take Triton's default, which Triton 3.9 announces will change (and warns about when left unset). It
#: touches only the statistics' sums of squares (an FMA rounds once, the exact tests allow for either); the
#: FP8 bits, amax, counts and scales involve no multiply-add. The interpreter ignores the option.
FP_FUSION = True

#: ``(kernel, launch_key)`` -> ``(CompiledKernel, names of the constexpr parameters in signature order)``
_HANDLES: dict[tuple, tuple] = {}


def launch_key(device: torch.device, args: tuple, kwargs: dict) -> tuple:
    """What a compiled kernel is specialised on, for these launchers' arguments: the device; per tensor its
    dtype and whether its data pointer is 16-byte aligned; per integer whether it fits int32, equals 1 and
    is a multiple of 16 (Triton's own rule, or finer where ``do_not_specialize`` lifts it); the constexprs
    and launch options as passed. Two launches with the same key run the same compiled kernel."""
    spec = []
    for a in args:
        if isinstance(a, torch.Tensor):
            spec.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            spec.append(("bool", a))
        elif isinstance(a, int):
            spec.append((-(2**31) <= a < 2**31, a == 1, a % 16 == 0))
        else:
            spec.append(type(a))
    return device.index, tuple(spec), tuple(kwargs.items())


def launch(kernel, grid0: int, *args, **kwargs) -> None:
    """``kernel[(grid0,)](*args, **kwargs)``, with the host work of Triton's generic launch done once per
    specialisation instead of per call.

    Triton's ``JITFunction.run`` binds the arguments, builds a specialisation key, looks the compiled kernel
    up and prepares launch metadata on every call: measured on an H200 host (Triton 3.6), about 60 us per
    quantize call, where the launch itself is about 10. The first launch with a given ``launch_key`` takes
    that path and keeps the ``CompiledKernel`` it returns; later ones call its launcher directly, with the
    same arguments in signature order (runtime arguments, then the constexprs) as ``JITFunction.run`` passes
    it (Triton 3.4 to 3.9). Runtime arguments come positionally, constexprs and options by keyword; the first
    argument is a tensor on the launch device. Triton's launch hooks (``knobs.runtime.launch_enter_hook``, set
    by its profilers) see only the first launch of each specialisation. Anything without a compiled form (the
    interpreter, ``TRITON_INTERPRET=1``) or launched on another device than the current one takes the
    generic path every time.
    """
    kwargs.setdefault("enable_fp_fusion", FP_FUSION)
    device = args[0].device
    if device.type != "cuda" or device.index != torch.cuda.current_device():
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            kernel[(grid0,)](*args, **kwargs)
        return
    key = (kernel, launch_key(device, args, kwargs))
    handle = _HANDLES.get(key)
    if handle is None:
        compiled = kernel[(grid0,)](*args, **kwargs)
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        names = getattr(kernel, "arg_names", None)
        tail = tuple(names[len(args) :]) if names is not None else ()
        if (
            hasattr(compiled, "packed_metadata")
            and getattr(compiled, "function", None) is not None
            and all(name in kwargs for name in tail)
        ):
            _HANDLES[key] = (compiled, tail)
        return
    compiled, tail = handle
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    compiled.run(
        grid0,
        1,
        1,
        stream,
        compiled.function,
        compiled.packed_metadata,
        None,
        None,
        None,
        *args,
        *(kwargs[name] for name in tail),
    )


class PreparedLaunch:
    """``launch(kernel, grid0, *args, **kwargs)`` for a caller whose grid, constexprs, options and integer
    arguments are the same at every call (a prepared quantize: one call shape), so that only the tensors
    change: after the first launch on the current CUDA device it calls the compiled kernel's launcher with
    no key built, as long as every tensor argument keeps the 16-byte alignment it had (the one part of
    ``launch_key`` a fresh tensor can change); otherwise it is ``launch``, and off CUDA (the interpreter, a
    recorder) the kernel's generic launch that ``launch`` makes there, without passing the keywords twice."""

    __slots__ = ("kernel", "grid", "kwargs", "_compiled", "_tail", "_aligned", "_index")

    def __init__(self, kernel, grid0: int, kwargs: dict) -> None:
        self.kernel, self.grid = kernel, grid0
        self.kwargs = dict(kwargs)
        self.kwargs.setdefault("enable_fp_fusion", FP_FUSION)
        self._compiled = self._tail = self._aligned = self._index = None

    def __call__(self, *args) -> None:
        compiled = self._compiled
        if compiled is not None:
            index = args[0].device.index
            if index == self._index == torch.cuda.current_device() and _alignment(args) == self._aligned:
                compiled.run(
                    self.grid,
                    1,
                    1,
                    torch._C._cuda_getCurrentRawStream(index),
                    compiled.function,
                    compiled.packed_metadata,
                    None,
                    None,
                    None,
                    *args,
                    *self._tail,
                )
                return
        device = args[0].device
        if device.type != "cuda":  # launch's generic path, without a second pass over the keywords
            self.kernel[(self.grid,)](*args, **self.kwargs)
            return
        launch(self.kernel, self.grid, *args, **self.kwargs)
        if compiled is None:
            handle = _HANDLES.get((self.kernel, launch_key(device, args, self.kwargs)))
            if handle is not None:
                compiled, names = handle
                self._compiled, self._tail = compiled, tuple(self.kwargs[name] for name in names)
                self._aligned, self._index = _alignment(args), device.index


def _alignment(args: tuple) -> tuple[bool, ...]:
    return tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))


@triton.jit
def load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """Load as float32, masked-out elements 0 (``mask=None``: a full block, no mask). bfloat16 is widened
    from its bits (``bits << 16``): exact for every value on every backend, where Triton 3.9's interpreter
    flushes bfloat16 subnormals to zero in a plain conversion."""
    raw = tl.load(ptr + offs) if mask is None else tl.load(ptr + offs, mask=mask, other=0)
    return to_f32(raw, IS_BF16)


@triton.jit
def to_f32(raw, IS_BF16: tl.constexpr):
    """Loaded values as float32 (``load_f32``'s conversion, for values loaded ahead of their use)."""
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
