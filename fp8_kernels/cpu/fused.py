"""Quantize and record every statistics column in one pass over the tensor on the CPU.

The PyTorch references (``reference/quantize.py``) take about a dozen passes over the tensor (abs, the
counts, the cast, the quality columns' decode, squares and sums). ``fused.c`` does it in one: per element the
scaled magnitude, its FP8 code by integer rounding, the byte, and every count, max, min and square,
vectorised with GCC's vector extensions; a tensor of more than 32768 elements is split over OpenMP threads
(torch's own runtime). The C file is compiled with the system's C compiler at the first CPU call, for the
machine it runs on, cached by a hash of its source, flags and target (``~/.cache/fp8scope``), and loaded
with ctypes (which drops the GIL around the call). Where no compiler is found or the build fails,
``fused_cpu_available()`` is False, a warning says so once, and the dispatch keeps the references.

Results, as the dispatch's contract demands: the FP8 bytes, amax, scale, the counts and ``min_abs`` bit for
bit the reference's; ``sum_sq`` and ``err_sq`` the same float32 terms summed in another order (float32 per
vector lane over at most 64 terms, then float64, in an order fixed by the tensor's size alone), within the
kernel tests' bound (``tests/kernels/exact_checks.py``). Inputs the kernel does not take (another input
dtype, a scale that is not a float32 CPU scalar, a row that is not a contiguous float64 CPU row, a scale
that is not finite and positive) go to the reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import math
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from ..reference.quantize import (
    _row_width,
    check_dbias_operand,
    column_sums_reference,
    fp8_max,
    overflow_threshold,
    quantize_current_reference,
    quantize_with_stats_reference,
    underflow_threshold,
)

__all__ = ["fused_cpu_available", "quantize_current_cpu", "quantize_with_stats_cpu"]

SOURCE = Path(__file__).with_name("fused.c")
#: ``-ffp-contract=off``: no fused multiply-add may change a rounding the reference makes
CFLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off", "-Wno-psabi")
_IN_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cache_dirs() -> list[Path]:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return [
        Path(base) / "fp8scope",
        Path(tempfile.gettempdir()) / f"fp8scope-{getattr(os, 'getuid', lambda: 0)()}",
    ]


def _build(cc: str) -> Path:
    """The shared library for this source, compiler and machine: from the cache, or compiled into it (to a
    temporary name first, then renamed, so that concurrent processes never load a partial file). Built for
    the machine itself (``-march=native``: the vector width follows the CPU), else for the compiler's
    baseline; the cache key holds the macros the target defines, so a cache shared by different CPUs keeps
    one build per instruction set."""
    errors = []
    for arch, omp in itertools.product((("-march=native",), ()), (("-fopenmp",), ())):
        flags = (*CFLAGS, *arch, *omp)
        target = subprocess.run(
            [cc, *arch, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True, timeout=60
        )
        if target.returncode != 0:
            errors.append(f"{cc} {' '.join(arch)}: {target.stderr.strip()[-500:]}")
            continue
        key = hashlib.sha256(SOURCE.read_bytes() + repr((flags, cc, target.stdout)).encode()).hexdigest()[:16]
        for cache in _cache_dirs():
            lib = cache / f"cpu_fused-{key}.so"
            if lib.exists():
                return lib
            try:
                cache.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
                os.close(fd)
                proc = subprocess.run(
                    [cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300
                )
            except OSError as e:  # an unwritable cache: try the next one
                errors.append(f"{cache}: {e}")
                continue
            if proc.returncode != 0:
                os.unlink(tmp)
                errors.append(f"{cc} {' '.join(flags)}: {proc.stderr.strip()[-1000:]}")
                break  # these flags do not build: try the next ones
            os.replace(tmp, lib)
            return lib
    raise RuntimeError("; ".join(errors))


@functools.cache
def _library() -> ctypes.CDLL | None:
    cc = _compiler()
    try:
        if cc is None:
            raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
        lib = ctypes.CDLL(str(_build(cc)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        warnings.warn(
            f"fp8_kernels: the fused CPU quantize kernel is unavailable ({e}); using the PyTorch "
            "reference on the CPU (correct, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    fn = lib.fp8_quantize_stats
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [p, i, ctypes.c_int64, p, p, i, i, p, p, p, i, i, p]
    fn.restype = i
    return lib


def fused_cpu_available() -> bool:
    """True where the fused CPU kernel is built and loaded (it is built at the first call)."""
    return _library() is not None


@functools.cache
def _params(fp8_dtype: torch.dtype) -> torch.Tensor:
    """The format's constants for the kernel, each from the reference's own functions."""
    fi = torch.finfo(fp8_dtype)
    threshold, inclusive = overflow_threshold(fp8_dtype)
    min_sub = float(fi.smallest_normal) * float(fi.eps)
    mant = round(-math.log2(float(fi.eps)))
    bias = 1 - round(math.log2(float(fi.smallest_normal)))
    values = [fp8_max(fp8_dtype), threshold, float(inclusive), underflow_threshold(fp8_dtype)]
    return torch.tensor(values + [float(fi.smallest_normal), min_sub, mant, bias], dtype=torch.float64)


def _takes(x: torch.Tensor, fp8_dtype: torch.dtype, stats: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in _IN_DTYPES
        and fp8_dtype in _FP8_DTYPES
        and (
            stats is None
            or (stats.device.type == "cpu" and stats.dtype == torch.float64 and stats.is_contiguous())
        )
        and _library() is not None
    )


def quantize_with_stats_cpu(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``quantize_with_stats_reference`` in one pass (same signature, same results; see the module).
    ``dbias``: the column sums appended, taken by torch after the pass (``column_sums_reference``)."""
    if dbias:
        check_dbias_operand(x)
        return (*quantize_with_stats_cpu(x, scale, fp8_dtype, stats, amax=amax), column_sums_reference(x))
    width = _row_width(stats)
    if not (
        _takes(x, fp8_dtype, stats)
        and scale.device.type == "cpu"
        and scale.dtype == torch.float32
        and scale.numel() == 1
    ):
        return quantize_with_stats_reference(x, scale, fp8_dtype, stats, amax=amax)
    x = x.detach().contiguous()
    q = torch.empty(x.shape, dtype=fp8_dtype)
    row = torch.empty(width, dtype=torch.float64) if stats is None else stats
    if amax is not None:  # recorded as the reference does: |amax|, NaN read as 0
        amax = torch.nan_to_num(amax.detach().abs().to(torch.float32), nan=0.0, posinf=math.inf)
    rc = _library().fp8_quantize_stats(
        x.data_ptr(),
        _IN_DTYPES[x.dtype],
        x.numel(),
        scale.data_ptr(),
        None,
        0,
        0,
        _params(fp8_dtype).data_ptr(),
        q.data_ptr(),
        row.data_ptr(),
        width,
        stats is not None,
        None if amax is None else amax.data_ptr(),
    )
    if rc != 0:  # a scale that is not finite and positive, or no memory (nothing was written): the reference
        return quantize_with_stats_reference(x, scale, fp8_dtype, stats, amax=amax)
    return q, row


def quantize_current_cpu(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    stats: torch.Tensor | None = None,
    *,
    power_2_scale: bool = False,
    return_scale_inv: bool = False,
    dbias: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``quantize_current_reference`` in two passes, the amax and the quantize pass, with the scale
    computed between them in C as ``current_scale_reference`` does: ``(q, scale, stats_row)``, or ``(q,
    scale, scale_inv, stats_row)`` with ``return_scale_inv``; ``dbias`` appends the column sums
    (``column_sums_reference``)."""
    if dbias:
        check_dbias_operand(x)
        out = quantize_current_cpu(
            x, fp8_dtype, stats, power_2_scale=power_2_scale, return_scale_inv=return_scale_inv
        )
        return (*out, column_sums_reference(x))
    width = _row_width(stats)
    if not _takes(x, fp8_dtype, stats):
        return quantize_current_reference(
            x, fp8_dtype, stats, power_2_scale=power_2_scale, return_scale_inv=return_scale_inv
        )
    x = x.detach().contiguous()
    q = torch.empty(x.shape, dtype=fp8_dtype)
    scale = torch.empty((), dtype=torch.float32)
    row = torch.empty(width, dtype=torch.float64) if stats is None else stats
    _library().fp8_quantize_stats(
        x.data_ptr(),
        _IN_DTYPES[x.dtype],
        x.numel(),
        None,
        scale.data_ptr(),
        1,
        bool(power_2_scale),
        _params(fp8_dtype).data_ptr(),
        q.data_ptr(),
        row.data_ptr(),
        width,
        stats is not None,
        None,
    )  # (a current scale is always finite and positive)
    return (q, scale, torch.reciprocal(scale), row) if return_scale_inv else (q, scale, row)
