"""The fused CPU kernel (``fp8_kernels.cpu.fused``) against the PyTorch references it replaces on the CPU:
FP8 bytes, amax, scale, counts and ``min_abs`` exact, the two sums of squares within ``same_row``'s bound;
delayed and current scaling, every input dtype, base and quality rows, fresh rows and accumulation, the
rounding ties of every FP8 value, every fp16 and bf16 value, random float32 bit patterns, tensors split
over threads, and the fallbacks (no compiler, inputs it does not take)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

import fp8_kernels
from fp8_kernels import (
    has_kernel,
    new_stats,
    quantize_current,
    quantize_current_reference,
    quantize_with_stats,
    quantize_with_stats_reference,
    reference_kernels,
)
from fp8_kernels.cpu.fused import (
    _compiler,
    fused_cpu_available,
    quantize_current_cpu,
    quantize_with_stats_cpu,
)
from tests.kernels.exact_checks import same, same_bits, same_row
from tests.kernels.kernel_cases import DTYPES, FP8, SHAPES, make_input
from tests.support import ROOT

NAN, INF = float("nan"), float("inf")
SCALES = [3.7, 1.0, 2.0**-7, 1e4, 448.0 / 1e5, 1.3e-36, 3.4028234663852886e38]


@pytest.fixture(autouse=True, scope="module")
def _built():
    if _compiler() is None:
        pytest.skip("no C compiler (cc, gcc or clang): the CPU runs the PyTorch references")
    assert fused_cpu_available(), "a C compiler is there but the fused CPU kernel did not build"


def _check_delayed(x: torch.Tensor, scale: float, fp8: torch.dtype, what: str) -> None:
    s = torch.tensor(scale)
    for quality in (False, True):
        q, row = quantize_with_stats_cpu(x, s, fp8, new_stats(quality=quality))
        q_ref, row_ref = quantize_with_stats_reference(x, s, fp8, new_stats(quality=quality))
        same_bits(q, q_ref, f"{what}: FP8 bytes")
        same_row(row, row_ref, f"{what}: row (quality={quality})")
    q, row = quantize_with_stats_cpu(x, s, fp8)  # a fresh row
    same_row(row, quantize_with_stats_reference(x, s, fp8)[1], f"{what}: fresh row")


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_delayed_matches_the_reference(dtype, fmt):
    for (shape_name, shape), scale in itertools.product(SHAPES.items(), SCALES):
        x = make_input(shape, DTYPES[dtype], FP8[fmt])
        _check_delayed(x, scale, FP8[fmt], f"{dtype} {fmt} {shape_name} scale {scale}")


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_current_matches_the_reference(dtype, fmt):
    fp8 = FP8[fmt]
    inputs = [make_input(shape, DTYPES[dtype], fp8) for shape in SHAPES.values()]
    inputs += [
        make_input((300,), DTYPES[dtype], fp8)[12:] * 1e-3,  # no specials: a finite amax
        torch.zeros(5, dtype=DTYPES[dtype]),  # zero amax: scale 1
        torch.full((3,), NAN, dtype=DTYPES[dtype]),  # all NaN: amax 0, scale 1
        torch.tensor([1e-42, -3e-41]).to(DTYPES[dtype]),  # FP8_MAX / amax overflows (float32 input)
    ]
    for x, pow2, quality in itertools.product(inputs, (False, True), (False, True)):
        what = f"{dtype} {fmt} {tuple(x.shape)} pow2={pow2} quality={quality}"
        q, scale, row = quantize_current_cpu(x, fp8, new_stats(quality=quality), power_2_scale=pow2)
        q_ref, scale_ref, row_ref = quantize_current_reference(
            x, fp8, new_stats(quality=quality), power_2_scale=pow2
        )
        same_bits(q, q_ref, f"{what}: FP8 bytes")
        same(scale, scale_ref, f"{what}: scale")
        same_row(row, row_ref, f"{what}: row")


@pytest.mark.parametrize("quality", [False, True], ids=["base", "quality"])
def test_micro_batches_accumulate_into_a_step_buffer_row(quality):
    # row 1 of a step buffer; rows 0 and 2 stay untouched. The middle micro-batch has the larger amax and
    # its own scale (the row reports the scale that scaled its amax), the last an empty one
    fp8 = torch.float8_e4m3fn
    xs = [make_input((33, 31), torch.float32, fp8), make_input((4097,), torch.bfloat16, fp8, seed=1) * 2]
    xs.append(torch.empty(0))
    buf, ref = new_stats(3, quality=quality), new_stats(quality=quality)
    for x, scale in zip(xs, (3.7, 0.5, 2.0), strict=True):
        quantize_with_stats_cpu(x, torch.tensor(scale), fp8, buf[1])
        quantize_with_stats_reference(x, torch.tensor(scale), fp8, ref)
    same_row(buf[1], ref, "accumulated row")
    same(buf[0], new_stats(quality=quality), "row 0")
    same(buf[2], new_stats(quality=quality), "row 2")
    for pow2 in (False, True):  # current scaling: each micro-batch its own scale
        cur, cur_ref = new_stats(quality=quality), new_stats(quality=quality)
        for x in xs:
            quantize_current_cpu(x, torch.float8_e5m2, cur, power_2_scale=pow2)
            quantize_current_reference(x, torch.float8_e5m2, cur_ref, power_2_scale=pow2)
        same_row(cur, cur_ref, f"accumulated current row (pow2={pow2})")
    # a NaN put in the row from outside: the max ignores it
    row, row_ref = new_stats(quality=quality), new_stats(quality=quality)
    row[0] = row_ref[0] = NAN
    quantize_with_stats_cpu(xs[0], torch.tensor(2.0), fp8, row)
    quantize_with_stats_reference(xs[0], torch.tensor(2.0), fp8, row_ref)
    same_row(row, row_ref, "row with a NaN amax")


def _fp8_values(fp8: torch.dtype) -> torch.Tensor:
    """Every non-negative finite FP8 value, ascending (float32)."""
    v = torch.arange(128, dtype=torch.uint8).view(fp8).to(torch.float32)
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("fmt", list(FP8))
def test_rounding_ties_and_neighbours_of_every_fp8_value(fmt):
    fp8 = FP8[fmt]
    v = _fp8_values(fp8)
    mid = (v[1:] + v[:-1]) / 2  # exact in float32: the ties
    pts = torch.cat([v, mid, torch.tensor([float(torch.finfo(fp8).max) * 1.5])])
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(INF)), torch.nextafter(pts, torch.tensor(0.0))])
    x = torch.cat([pts, -pts])
    for scale in (1.0, 2.0, 0.75):  # 0.75: the products round (the scaled values move off the ties)
        _check_delayed(x / 2 if scale == 2.0 else x, scale, fp8, f"{fmt} ties, scale {scale}")


@pytest.mark.parametrize("fmt", list(FP8))
def test_every_half_precision_value_and_random_float32_bits(fmt):
    fp8 = FP8[fmt]
    every16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    g = torch.Generator().manual_seed(5)
    bits32 = torch.randint(-(2**31), 2**31, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    for x in (every16.view(torch.float16), every16.view(torch.bfloat16), bits32.view(torch.float32)):
        for scale in (1.0, 3.7, 1e-20, 1e20):
            _check_delayed(x, scale, fp8, f"{fmt} {x.dtype} all values, scale {scale}")


def test_split_over_threads_gives_the_same_bits():
    # more than one OpenMP piece (32768 elements): the row does not depend on the thread count
    x = make_input((3, 50_001), torch.float32, torch.float8_e4m3fn) * 1e-3
    s = torch.tensor(3.7)
    _check_delayed(x, 3.7, torch.float8_e4m3fn, "150003 elements")
    threads = torch.get_num_threads()
    delayed, current = [], []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            delayed.append(quantize_with_stats_cpu(x, s, torch.float8_e5m2)[1])
            current.append(quantize_current_cpu(x, torch.float8_e5m2)[2])
    finally:
        torch.set_num_threads(threads)
    for rows in (delayed, current):
        assert all(torch.equal(r, rows[0]) for r in rows[1:]), rows


def test_inputs_it_does_not_take_go_to_the_reference():
    fp8 = torch.float8_e4m3fn
    x = make_input((40, 30), torch.float32, fp8)
    cases = [
        (x.double(), torch.tensor(3.7)),  # float64 input
        (x, torch.tensor(3.7, dtype=torch.float64)),  # float64 scale
        (x, torch.tensor(0.0)),  # a scale that is not finite and positive (the sums: NaN)
        (x, torch.tensor(INF)),
    ]
    for xi, s in cases:  # the reference itself: every column bit for bit
        q, row = quantize_with_stats_cpu(xi, s, fp8)
        q_ref, row_ref = quantize_with_stats_reference(xi, s, fp8)
        same_bits(q, q_ref, f"{xi.dtype} {s.dtype} {s.item()}: FP8 bytes")
        same(row, row_ref, f"{xi.dtype} {s.dtype} {s.item()}: row")
    _check_delayed(x.t(), 3.7, fp8, "non-contiguous")  # taken (made contiguous)
    with pytest.raises(ValueError, match="row"):
        quantize_with_stats_cpu(x, torch.tensor(1.0), fp8, torch.zeros(8, dtype=torch.float64))


def test_dispatch_runs_it_on_the_cpu():
    assert has_kernel("quantize", "cpu") and has_kernel("current", "cpu")
    assert not has_kernel("quantize_transposed", "cpu")  # the transposed entries transpose its output
    x = make_input((127, 129), torch.bfloat16, torch.float8_e5m2)
    s = torch.tensor(3.7)
    calls = []
    fp8_kernels.register("cpu", quantize=lambda *a, **k: calls.append(1) or quantize_with_stats_cpu(*a, **k))
    try:
        quantize_with_stats(x, s, torch.float8_e5m2)
    finally:
        fp8_kernels.register("cpu")
    assert calls == [1] and fp8_kernels.dispatch._lookup("quantize", "cpu") is quantize_with_stats_cpu
    assert fp8_kernels.dispatch._lookup("current", "cpu") is quantize_current_cpu
    q, row = quantize_with_stats(x, s, torch.float8_e5m2)
    q2, qt, row2 = fp8_kernels.quantize_with_stats_transposed(x, s, torch.float8_e5m2)
    with reference_kernels():
        assert not has_kernel("quantize", "cpu")
        q_ref, row_ref = quantize_with_stats(x, s, torch.float8_e5m2)
        _, scale_ref, cur_ref = quantize_current(x, torch.float8_e5m2)
    same_bits(q, q_ref, "dispatched FP8 bytes")
    same_row(row, row_ref, "dispatched row")
    same_bits(qt, q_ref.t().contiguous(), "transposed output")
    same_row(row2, row_ref, "transposed entry's row")
    _, scale, cur = quantize_current(x, torch.float8_e5m2)
    same(scale, scale_ref, "current scale")
    same_row(cur, cur_ref, "current row")


def test_without_a_compiler_the_references_run_with_one_warning():
    code = (
        "import warnings, torch, fp8_kernels\n"
        "from fp8_kernels.cpu.fused import fused_cpu_available\n"
        "x = torch.randn(1000) * 100\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    q, row = fp8_kernels.quantize_with_stats(x, torch.tensor(2.0), torch.float8_e4m3fn)\n"
        "    fp8_kernels.quantize_current(x, torch.float8_e4m3fn)\n"
        "assert not fused_cpu_available() and not fp8_kernels.has_kernel('quantize', 'cpu')\n"
        "assert len(w) == 1 and 'no C compiler' in str(w[0].message), [str(m.message) for m in w]\n"
        "q_ref, row_ref = fp8_kernels.quantize_with_stats_reference(\n"
        "    x, torch.tensor(2.0), torch.float8_e4m3fn)\n"
        "assert torch.equal(row, row_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PATH": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
