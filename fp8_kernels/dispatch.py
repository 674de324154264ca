"""The one dispatch point for quantize-and-record-statistics (delayed and current scaling, block scaling),
amax, exponent histograms and the scale update.

Each op chooses an implementation by the device type of its tensors. CUDA tensors use the Triton kernels
(``triton/``) when triton is installed and the GPU has FP8 support (sm_89+); they register themselves
here at the first CUDA call, so importing ``fp8_kernels`` never imports triton. CPU tensors use the fused
one-pass C kernel (``cpu.fused``) for quantize-with-statistics, delayed and current, where it builds (a C
compiler, at the first CPU call); the transposed variants then transpose its output. Everything else uses
the pure-PyTorch references. These are the built-in implementations; ``register`` puts others in front of
them. ``use_reference(True)`` (or ``with reference_kernels():``) forces the references everywhere, to
compare against them or to debug on a GPU. Tensors beyond ``KERNEL_MAX_NUMEL`` elements (the kernels' int32
offsets) use the references too.

A registered implementation must follow the reference's contract exactly (same signature, same statistics
row, same bits). The quantize ops pass ``dbias=True`` (the bias gradient of a 2-D ``grad_output``, one more
element in the result) only when a caller asks for it, having checked ``x`` is 2-D.
The scale update's reference is ``fp8_trainer.scaling.delayed_scaling_update``, which this package does not
import: ``fused_scale_update`` returns ``None`` where the caller should use it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .device import fp8_gpu
from .reference.block_quantize import BlockQuantized, quantize_blocks
from .reference.histogram import exponent_histogram_reference
from .reference.quantize import (
    KERNEL_MAX_NUMEL,
    check_dbias_operand,
    quantize_current_reference,
    quantize_with_stats_reference,
    tensor_amax_reference,
)

__all__ = [
    "block_quantize",
    "exponent_histogram",
    "fp8_gpu",
    "fused_scale_update",
    "generation",
    "has_kernel",
    "prepare_quantize",
    "quantize_current",
    "quantize_current_transposed",
    "quantize_with_stats",
    "quantize_with_stats_transposed",
    "reference_kernels",
    "register",
    "registered",
    "restore",
    "tensor_amax",
    "triton_available",
    "use_reference",
]

_OPS = (
    "quantize",
    "quantize_transposed",
    "current",
    "current_transposed",
    "amax",
    "histogram",
    "scale_update",
    "block_quantize",
)
#: implementations given to ``register``: they come first
_TABLES: dict[str, dict[str, Callable]] = {op: {} for op in _OPS}
#: the built-in kernels (Triton on CUDA, the fused C kernel on the CPU), filled at the first call
_BUILTIN: dict[str, dict[str, Callable]] = {op: {} for op in _OPS}
_force_reference = False
#: bumped by every change of routing (``register``, ``use_reference``, ``restore``): a prepared call made
#: before it (``prepare_quantize``) is no longer the one dispatch would make
_generation = 0


def generation() -> int:
    """The routing's generation (see ``_generation``): a holder of prepared calls keys them on it."""
    return _generation


def register(
    device_type: str,
    *,
    quantize: Callable | None = None,
    quantize_transposed: Callable | None = None,
    current: Callable | None = None,
    current_transposed: Callable | None = None,
    amax: Callable | None = None,
    histogram: Callable | None = None,
    scale_update: Callable | None = None,
    block_quantize: Callable | None = None,
) -> None:
    """Route ``device_type`` (e.g. ``"cuda"``) to other implementations; ``None`` restores the built-in one
    (the device's kernel where there is one, else the reference)."""
    given = {
        "quantize": quantize,
        "quantize_transposed": quantize_transposed,
        "current": current,
        "current_transposed": current_transposed,
        "amax": amax,
        "histogram": histogram,
        "scale_update": scale_update,
        "block_quantize": block_quantize,
    }
    global _generation
    for op, fn in given.items():
        if fn is None:
            _TABLES[op].pop(device_type, None)
        else:
            _TABLES[op][device_type] = fn
    _generation += 1


def registered() -> dict[str, dict[str, Callable]]:
    """A copy of what ``register`` routed, for ``restore``."""
    return {op: dict(table) for op, table in _TABLES.items()}


def restore(tables: dict[str, dict[str, Callable]]) -> None:
    """Route as ``tables`` (from ``registered``) says, dropping every registration made since."""
    global _generation
    for op, table in _TABLES.items():
        table.clear()
        table.update(tables.get(op, {}))
    _generation += 1


def use_reference(enabled: bool = True) -> bool:
    """Force the PyTorch references on every device (``True``) or restore dispatch; returns the old value."""
    global _force_reference, _generation
    previous, _force_reference = _force_reference, bool(enabled)
    _generation += 1
    return previous


@contextmanager
def reference_kernels() -> Iterator[None]:
    """``with reference_kernels():`` runs the block on the PyTorch references."""
    previous = use_reference(True)
    try:
        yield
    finally:
        use_reference(previous)


def triton_available() -> bool:
    """True where triton imports (the kernels can run, compiled on a GPU or under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _register_triton_for_cuda() -> bool:
    """Register the Triton kernels for CUDA once, if triton is installed and the GPU supports FP8."""
    if not (fp8_gpu() and triton_available()):
        return False
    from .triton.block_quantize import block_quantize_triton
    from .triton.current import (
        quantize_current_transposed_triton,
        quantize_current_triton,
        tensor_amax_triton,
    )
    from .triton.histogram import exponent_histogram_triton
    from .triton.quantize import quantize_with_stats_transposed_triton, quantize_with_stats_triton
    from .triton.scale_update import scale_update_triton

    impls = {
        "quantize": quantize_with_stats_triton,
        "quantize_transposed": quantize_with_stats_transposed_triton,
        "current": quantize_current_triton,
        "current_transposed": quantize_current_transposed_triton,
        "amax": tensor_amax_triton,
        "histogram": exponent_histogram_triton,
        "scale_update": scale_update_triton,
        "block_quantize": block_quantize_triton,
    }
    for op, fn in impls.items():
        _BUILTIN[op]["cuda"] = fn
    return True


@functools.cache
def _register_fused_cpu() -> bool:
    """Register the fused CPU kernel once, if it builds (else a warning, once, and the references)."""
    from .cpu.fused import fused_cpu_available, quantize_current_cpu, quantize_with_stats_cpu

    if not fused_cpu_available():
        return False
    _BUILTIN["quantize"]["cpu"] = quantize_with_stats_cpu
    _BUILTIN["current"]["cpu"] = quantize_current_cpu
    return True


def _lookup(op: str, device_type: str, numel: int = 0) -> Callable | None:
    if _force_reference or numel > KERNEL_MAX_NUMEL:
        return None
    if device_type == "cuda":
        _register_triton_for_cuda()
    elif device_type == "cpu":
        _register_fused_cpu()
    return _TABLES[op].get(device_type) or _BUILTIN[op].get(device_type)


def _dbias_kw(x: torch.Tensor, dbias: bool) -> dict:
    """The ``dbias`` keyword for an implementation: given only when asked for, so that one registered
    without it still serves every other call; a bad operand is refused before any work."""
    if not dbias:
        return {}
    check_dbias_operand(x)
    return {"dbias": True}


def quantize_with_stats(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Quantize ``x`` with ``scale`` and record its statistics (``reference.quantize``): ``(q, row)``.

    ``dbias``: ``x`` is a 2-D ``grad_output`` (ValueError otherwise) and the call also returns the bias
    gradient ``x.sum(0)`` (accumulated in float32, in ``x``'s dtype): ``(q, row, dbias)``. The Triton
    kernel takes it in the quantize pass itself (no second read of ``x``, no launch of its own).
    """
    extra = _dbias_kw(x, dbias)
    fn = _lookup("quantize", x.device.type, x.numel()) or quantize_with_stats_reference
    return fn(x, scale, fp8_dtype, stats, amax=amax, **extra)


def quantize_with_stats_transposed(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """As ``quantize_with_stats`` for a 2-D ``x``, also returning ``q.t().contiguous()``: ``(q, qt, row)``,
    ``(q, qt, row, dbias)`` with ``dbias``.

    The Triton kernel writes both layouts (and the column sums) in the same pass over ``x``; the reference
    transposes ``q``.
    """
    extra = _dbias_kw(x, dbias)
    fn = _lookup("quantize_transposed", x.device.type, x.numel())
    if fn is not None:
        return fn(x, scale, fp8_dtype, stats, amax=amax, **extra)
    if x.dim() != 2:
        raise ValueError(f"x: the transposed output needs a 2-D tensor, got shape {tuple(x.shape)}")
    q, *rest = quantize_with_stats(x, scale, fp8_dtype, stats, amax=amax, dbias=dbias)
    return (q, q.t().contiguous(), *rest)


def quantize_current(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    power_2_scale: bool = False,
    return_scale_inv: bool = False,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Current scaling: quantize ``x`` with ``FP8_MAX / max |x|`` (NaN elements ignored by the max) and record
    its statistics, one call for the amax pass, the scale and the quantize pass: ``(q, scale, stats_row)``
    (``quantize_current_reference``). ``power_2_scale`` rounds the scale down to a power of two
    (Transformer Engine's ``force_pow_2_scales``).

    On CUDA the Triton kernels derive the scale on the device between their two passes; on the CPU it is
    the reference's torch ops. Either way nothing is read on the host.

    ``return_scale_inv``: ``(q, scale, scale_inv, stats_row)``, ``scale_inv`` being
    ``torch.reciprocal(scale)`` bit for bit and 16-byte aligned (the GEMM's operand scale); the Triton
    kernels write it in their quantize pass, which saves the GEMM path a launch per tensor. Every
    ``current`` kernel takes this keyword.

    ``dbias``: the column sums of a 2-D ``x`` appended, as in ``quantize_with_stats`` (the Triton kernels
    take them in their quantize pass).
    """
    extra = _dbias_kw(x, dbias)
    fn = _lookup("current", x.device.type, x.numel()) or quantize_current_reference
    return fn(x, fp8_dtype, stats, power_2_scale=power_2_scale, return_scale_inv=return_scale_inv, **extra)


def quantize_current_transposed(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    power_2_scale: bool = False,
    return_scale_inv: bool = False,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """As ``quantize_current`` for a 2-D ``x``, also returning ``qt = q.t().contiguous()``:
    ``(q, qt, scale, row)``, or ``(q, qt, scale, scale_inv, row)`` with ``return_scale_inv``; ``dbias``
    appends the column sums.

    The Triton kernel writes both layouts in its quantize pass; the reference transposes ``q``.
    """
    extra = _dbias_kw(x, dbias)
    fn = _lookup("current_transposed", x.device.type, x.numel())
    if fn is not None:
        kw = dict(power_2_scale=power_2_scale, return_scale_inv=return_scale_inv, **extra)
        return fn(x, fp8_dtype, stats, **kw)
    if x.dim() != 2:
        raise ValueError(f"x: the transposed output needs a 2-D tensor, got shape {tuple(x.shape)}")
    q, *rest = quantize_current(
        x, fp8_dtype, stats, power_2_scale=power_2_scale, return_scale_inv=return_scale_inv, dbias=dbias
    )
    return (q, q.t().contiguous(), *rest)


def prepare_quantize(
    op: str,
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    row: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    dbias: bool = False,
    power_2_scale: bool = False,
) -> Callable | None:
    """A prepared call of quantize op ``op`` (``"quantize"``, ``"quantize_transposed"``, ``"current"``,
    ``"current_transposed"``) for tensors like ``x``, statistics rows like ``row`` and (delayed scaling)
    scales like ``scale``: ``fn(x, scale, row) -> (q, qt or None, scale_inv or None, column sums or None)``
    (``scale_inv`` from current scaling's kernels; ``None`` for delayed scaling, whose caller holds it), with
    the checks and launch planning of the op done once, here. ``None`` where the implementation routed to
    offers no prepared form (the references, the CPU's fused kernels): call the op itself. Valid while
    ``generation()`` stays the same."""
    if _force_reference or x.numel() > KERNEL_MAX_NUMEL:
        return None
    prepare = getattr(_lookup(op, x.device.type, x.numel()), "prepare", None)
    if prepare is None:
        return None
    return prepare(x, fp8_dtype, row, scale, dbias=dbias, power_2_scale=power_2_scale)


def has_kernel(op: str, device_type: str) -> bool:
    """True where ``op`` (a ``register`` keyword, e.g. ``"quantize_transposed"``) runs another implementation
    than the PyTorch reference on ``device_type`` (and the reference switch is off)."""
    if op not in _OPS:
        raise ValueError(f"op: unknown kernel op {op!r}; expected one of {sorted(_OPS)}")
    return _lookup(op, device_type) is not None


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as float32 0-dim tensor, NaN elements ignored (0 for an empty or all-NaN tensor)."""
    return (_lookup("amax", x.device.type, x.numel()) or tensor_amax_reference)(x)


def exponent_histogram(x: torch.Tensor) -> torch.Tensor:
    """Counts per power of two of ``x`` (layout: ``reference.histogram``), int64 on ``x``'s device."""
    return (_lookup("histogram", x.device.type, x.numel()) or exponent_histogram_reference)(x)


def fused_scale_update(device: torch.device | str) -> Callable | None:
    """The one-launch scale update of all tensors for ``device``, or ``None`` where the caller should run
    the reference (``fp8_trainer.scaling.delayed_scaling_update``). Signature: ``triton.scale_update``,
    whose new ``scale`` and ``scale_inv`` are 16-byte-aligned vectors (``aligned_scales``); the reference
    returns plain tensors, which the caller lays out itself."""
    return _lookup("scale_update", torch.device(device).type)


def block_quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    block: tuple[int, int],
    scale_format: str,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    stats: torch.Tensor | None = None,
    block_stats: torch.Tensor | None = None,
) -> tuple[BlockQuantized, bool]:
    """Block-scaled quantization (``reference.block_quantize.quantize_blocks``, same arguments, same bits):
    ``(q, recorded)``. Where a kernel is registered (CUDA: ``triton.block_quantize``) and the step's rows
    are given (``stats``, its statistics row, and ``block_stats``, its block row), the kernel merges the
    quantization's statistics into them in the same pass and ``recorded`` is True; the reference records
    nothing (``recorded`` False), and its caller computes them itself
    (``fp8_trainer.block_linear.record_block_stats``)."""
    fn = _lookup("block_quantize", x.device.type, x.numel())
    if fn is not None:
        q = fn(
            x,
            fp8_dtype,
            block,
            scale_format,
            power_2_scale=power_2_scale,
            amax_epsilon=amax_epsilon,
            stats=stats,
            block_stats=block_stats,
        )
        return q, stats is not None
    q = quantize_blocks(
        x, fp8_dtype, block, scale_format, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon
    )
    return q, False
