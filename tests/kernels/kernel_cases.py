"""Triton kernel cases against their PyTorch references, shared by the CPU and GPU test files.

Each case is a function of the device. On the CPU the kernels run under ``TRITON_INTERPRET=1``, which must
be set before triton is imported and holds for the whole process, so ``test_triton_interpreter.py`` runs
this module in a subprocess (``python -m tests.kernels.kernel_cases --json OUT`` from the repository root)
and turns each case's result into one parametrised test. ``test_kernels_gpu.py`` runs the same cases
compiled on CUDA. The cases of the kernels inside the FP8 ``Linear`` live in ``linear_cases.py``; both
register theirs in ``case_registry.py``.

What is compared, exactly (no tolerances): amax, scale, counts and numel of the statistics row; the
pre-cast values ``clamp(x * scale)`` and the FP8 bits against PyTorch's cast of them; histograms;
histories and scales of the scale update. Sizes cover the kernels' code paths: full blocks only, full
blocks plus a masked tail, a tail only, 2-D shapes with and without edge tiles and with rows that are
(``DIV`` 16) and are not multiples of 16. The FP8 bits come from two different code paths: on a GPU with
a saturating cast (sm_89+) the cast alone, elsewhere (here, under the interpreter, whose float8 cast rounds
some values wrongly: docs/fp8-semantics.md, "Known traps") an arithmetic rounding the cast then only has to
carry over
(``triton.quantize._to_fp8``). The transposed output is compared with the transpose of the kernel's own
``q``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from fp8_kernels import exponent_histogram_reference, quantize_with_stats_reference, tensor_amax_reference
from tests.kernels import linear_cases  # noqa: F401  (registers the cases of the kernels inside the FP8 Linear)
from tests.kernels.case_registry import CASES, case, case_names
from tests.kernels.exact_checks import same as _same
from tests.kernels.exact_checks import same_bits as _same_bits
from tests.kernels.exact_checks import same_row as _same_row

NAN, INF = float("nan"), float("inf")
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = {
    "1": (1,),
    "17": (17,),
    "127x129": (127, 129),  # edge tiles on both sides, rows not multiples of 16
    "48x80": (48, 80),  # rows multiples of 16 (the aligned specialisation), edge tiles on both sides
    "64x96": (64, 96),  # full tiles only (the interpreter's tile is 32x32)
    "1x1": (1, 1),
    "2048": (2048,),  # full blocks only (the interpreter's block is 1024)
    "4097": (4097,),  # full blocks and a one-element tail
    "empty": (0,),
    "0x7": (0, 7),
}
SCALE = 3.7  # not a power of two: products round


# ----- inputs -----
def make_input(shape: tuple[int, ...], dtype: torch.dtype, fp8: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values over many decades plus every special: zeros, NaN, +-Inf, beyond the FP8 range, and values
    whose scaled result lands in the FP8 subnormal range or below half its smallest subnormal."""
    n = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(fp8)
    min_sub = float(fi.smallest_normal) * float(fi.eps)
    x = torch.randn(n, generator=g) * torch.logspace(-12, 8, max(n, 1))[:n]
    specials = [
        3 * min_sub / SCALE,  # scaled: an FP8 subnormal
        0.0, -0.0, NAN, INF, -INF,
        2 * float(fi.max) / SCALE, -1e6, 3e38,  # saturate
        0.4 * min_sub / SCALE, -0.5 * min_sub / SCALE,  # underflow to zero (the second is the exact tie)
        float(torch.finfo(dtype).tiny) / 4,  # a subnormal of the input dtype itself
    ]  # fmt: skip
    k = min(n, len(specials))
    x[:k] = torch.tensor(specials[:k])
    return x.to(dtype).reshape(shape)


def _expected_precast(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    fmax = float(torch.finfo(fp8).max)
    return (x.to(torch.float32) * scale).clamp(-fmax, fmax)


# ----- fused quantize + statistics (delayed scaling) -----
def _quantize_case(dtype_name: str, fmt: str, shape_name: str, transpose: bool):
    def run(device: torch.device) -> None:
        from fp8_kernels.triton.quantize import launch_quantize

        dtype, fp8, shape = DTYPES[dtype_name], FP8[fmt], SHAPES[shape_name]
        x = make_input(shape, dtype, fp8).to(device)
        x2 = make_input(shape, dtype, fp8, seed=1).to(device) * 0.5
        scale = torch.tensor(SCALE, device=device)
        # two micro-batches accumulating into row 1 of a step buffer (rows 0 and 2 must stay untouched)
        buf = torch.zeros(3, 6, dtype=torch.float64, device=device)
        ref = torch.zeros(6, dtype=torch.float64, device=device)
        for xi in (x, x2):
            pre = torch.empty(shape, dtype=torch.float32, device=device)
            q, qt, _, _ = launch_quantize(xi, scale, fp8, buf[1], precast=pre, transpose=transpose)
            q_ref, _ = quantize_with_stats_reference(xi, scale, fp8, ref)
            expected = _expected_precast(xi, scale, fp8)
            _same(pre, expected, "pre-cast values")
            assert q.dtype == fp8 and q.shape == xi.shape
            if transpose:
                _same_bits(qt, q.t().contiguous(), "transposed output vs q.t()")
            _same_bits(q, expected.to(fp8), "FP8 bits vs torch cast of the pre-cast values")
            _same_bits(q, q_ref, "FP8 bits vs reference")
        _same(buf[1], ref, "statistics row after two micro-batches")
        _same(buf[0], torch.zeros_like(buf[0]), "neighbouring row 0")
        _same(buf[2], torch.zeros_like(buf[2]), "neighbouring row 2")

    return run


for _d in DTYPES:
    for _f in FP8:
        for _s in SHAPES:
            case(f"quantize-{_d}-{_f}-{_s}")(_quantize_case(_d, _f, _s, False))
            if len(SHAPES[_s]) == 2:
                case(f"quantize_transposed-{_d}-{_f}-{_s}")(_quantize_case(_d, _f, _s, True))


def _boundary_case(dtype_name: str, fmt: str):
    def run(device: torch.device) -> None:
        from fp8_kernels.reference.quantize import overflow_threshold
        from fp8_kernels.triton.quantize import launch_quantize

        dtype, fp8 = DTYPES[dtype_name], FP8[fmt]
        fi = torch.finfo(fp8)
        fmax, half = float(fi.max), float(fi.smallest_normal) * float(fi.eps) / 2
        threshold, inclusive = overflow_threshold(fp8)
        assert (threshold, inclusive) == ((464.0, False) if fmt == "e4m3" else (61440.0, True))

        def step(v: float, direction: float) -> float:
            return torch.nextafter(torch.tensor(v, dtype=dtype), torch.tensor(direction, dtype=dtype)).item()

        # scale 2 (a power of two: every product exact), so x = (the scaled value wanted) / 2; the
        # neighbours are taken in x's own dtype
        xs = [
            half / 2,
            -half / 2,
            half * (1 + 2**-5) / 2,
            fmax / 2,
            -fmax / 2,
            step(fmax / 2, INF),
            threshold / 2,
            -threshold / 2,
            step(threshold / 2, 0.0),
            step(threshold / 2, INF),
            half,
            0.0,
        ]
        x = torch.tensor(xs, dtype=torch.float64).to(dtype)
        assert x.double().tolist() == xs, "the inputs are not exact in this dtype"
        x = x.to(device)
        scaled = [2 * v for v in xs]
        scale = torch.tensor(2.0, device=device)
        pre = torch.empty(x.shape, dtype=torch.float32, device=device)
        q, _, row, _ = launch_quantize(x, scale, fp8, None, precast=pre)
        _, row_ref = quantize_with_stats_reference(x, scale, fp8)
        _same_row(row, row_ref, "statistics row")
        # from the definitions: the exact ties at half the smallest subnormal underflow (round to even: 0),
        # just above them does not; above FP8_MAX up to the rounding threshold is no overflow (it rounds to
        # FP8_MAX), the threshold itself is one for E5M2 only (its tie goes up), beyond it always
        overflow = sum(abs(v) >= threshold if inclusive else abs(v) > threshold for v in scaled)
        assert overflow == (3 if inclusive else 1)
        assert row[2:6].tolist() == [overflow, 2, 0, len(xs)], row.tolist()
        _same(pre, _expected_precast(x, scale, fp8), "pre-cast values")
        assert q.float()[:3].tolist() == [0.0, -0.0, 2 * half] and q.float()[5].item() == fmax

    return run


for _d in DTYPES:
    for _f in FP8:
        case(f"quantize-boundaries-{_d}-{_f}")(_boundary_case(_d, _f))


def _saturating_amax(fp8: torch.dtype) -> float:
    """An amax whose delayed scale ``fl(FP8_MAX / amax)`` maps it above FP8_MAX in float32 (found by search;
    about one amax in eleven does): the old ``> FP8_MAX`` rule counted it as an overflow every step."""
    fmax = torch.tensor(float(torch.finfo(fp8).max))
    amaxes = torch.linspace(1.0, 2.0, 4097)[1:]
    scaled = amaxes * (fmax / amaxes)
    hit = (scaled > fmax).nonzero()
    assert hit.numel(), "no amax found that the scale maps above FP8_MAX"
    return amaxes[hit[0, 0]].item()


@case("quantize-scaled-amax-a-float32-ulp-above-max-is-no-overflow")
def _amax_at_max(device: torch.device) -> None:
    from fp8_kernels.triton.quantize import launch_quantize

    for fp8 in FP8.values():
        amax = _saturating_amax(fp8)
        fmax = torch.tensor(float(torch.finfo(fp8).max))
        scale = (fmax / torch.tensor(amax)).to(device)
        x = torch.linspace(-amax, amax, 4097).to(device)  # max |x| is amax itself
        pre = torch.empty(x.shape, dtype=torch.float32, device=device)
        q, _, row, _ = launch_quantize(x, scale, fp8, None, precast=pre)
        _, row_ref = quantize_with_stats_reference(x, scale, fp8)
        _same_row(row, row_ref, "statistics row")
        assert (torch.tensor(amax) * scale.cpu()).item() > fmax.item()
        assert row[0].item() == amax and row[2].item() == 0, row.tolist()  # nothing saturated
        assert q.float().abs().max().item() == fmax.item()


@case("quantize-accumulated-amax-keeps-its-scale")
def _amax_keeps_scale(device: torch.device) -> None:
    # three micro-batches into one row, the middle one saturating the first's scale: the row's amax is
    # reported beside the scale that scaled it (delayed: given scales; current: each call's own)
    from fp8_kernels.triton.current import quantize_current_transposed_triton, quantize_current_triton
    from fp8_kernels.triton.quantize import launch_quantize
    from fp8_trainer.scaling import current_scale

    g = torch.Generator().manual_seed(11)
    batches = [torch.rand(33, 40, generator=g) * a for a in (1.0, 50.0, 1.0)]
    scales = [448.0, 8.0, 300.0]
    for how in ("delayed-1d", "delayed-2d", "current-1d", "current-2d"):
        buf = torch.zeros(3, 6, dtype=torch.float64, device=device)
        ref = torch.zeros(6, dtype=torch.float64, device=device)
        used = []
        for x, s in zip(batches, scales, strict=True):
            x = x.to(device)
            if how.startswith("delayed"):
                scale = torch.tensor(s, device=device)
                launch_quantize(x, scale, FP8["e4m3"], buf[1], transpose=how.endswith("2d"))
            elif how == "current-1d":
                _, scale, _ = quantize_current_triton(x, FP8["e4m3"], buf[1])
            else:
                _, _, scale, _ = quantize_current_transposed_triton(x, FP8["e4m3"], buf[1])
            quantize_with_stats_reference(x, scale, FP8["e4m3"], ref)
            used.append(scale.item())
        _same(buf[1], ref, f"accumulated row ({how})")
        amax = max(b.abs().max().item() for b in batches)
        assert buf[1, 0].item() == amax and buf[1, 1].item() == used[1], (how, buf[1].tolist(), used)
        if how.startswith("current"):
            assert used[1] == current_scale(torch.tensor(amax), 448.0).item()


@case("quantize-many-blocks-per-program")
def _many_blocks(device: torch.device) -> None:
    # every program walks the most blocks it may (MAX_BLOCKS_PER_PROGRAM, the last one partial), each element
    # position collecting overflows, underflows and non-finite elements in its packed per-slot counters
    # (8 bits apart, at most LANE per block): the fullest the counters get
    from fp8_kernels.triton.launch import MAX_BLOCKS_PER_PROGRAM, block_1d, cdiv, grid_cap, persistent_grid
    from fp8_kernels.triton.quantize import launch_quantize

    block, _ = block_1d(device)
    n = MAX_BLOCKS_PER_PROGRAM * block * grid_cap(device) - 5
    assert cdiv(cdiv(n, block), persistent_grid(cdiv(n, block), device)) == MAX_BLOCKS_PER_PROGRAM
    pattern = torch.tensor([1e6, 1e-30, NAN, -INF, 1.0, -2e5, 0.0])
    x = pattern.repeat(n // len(pattern) + 1)[:n].to(device)
    for transpose, shape in ((False, (n,)), (True, (n // 97, 97))):
        xi = x[: math.prod(shape)].reshape(shape)
        _, _, row, _ = launch_quantize(xi, torch.tensor(SCALE, device=device), FP8["e4m3"], None,
                                       transpose=transpose)  # fmt: skip
        _, row_ref = quantize_with_stats_reference(xi, torch.tensor(SCALE, device=device), FP8["e4m3"])
        _same_row(row, row_ref, f"statistics row (transpose={transpose})")
        assert min(row[2:5].tolist()) > 1000, row.tolist()


def _nan_case(dtype_name: str, fmt: str, shape_name: str, fill: str, transpose: bool):
    """NaN is ignored by the amax (Transformer Engine's fmaxf) and counted as non-finite: NaN sprinkled
    among finite values, an all-NaN tensor, Inf among finite values (amax Inf)."""

    def run(device: torch.device) -> None:
        from fp8_kernels.triton.quantize import launch_quantize

        dtype, fp8, shape = DTYPES[dtype_name], FP8[fmt], SHAPES[shape_name]
        n = math.prod(shape)
        g = torch.Generator().manual_seed(7)
        x = torch.randn(n, generator=g) * 10
        if fill == "nan-finite":
            x[torch.randperm(n, generator=g)[: max(1, n // 7)]] = NAN
        elif fill == "all-nan":
            x[:] = NAN
        else:
            x[torch.randperm(n, generator=g)[:2]] = torch.tensor([INF, -INF])
        x = x.to(dtype).reshape(shape).to(device)
        finite_or_inf = x.float()[~x.float().isnan()].abs()
        expected_amax = finite_or_inf.max().item() if finite_or_inf.numel() else 0.0
        scale = torch.tensor(SCALE, device=device)
        # into a row already holding a NaN amax (written from outside): fmax replaces it
        buf = torch.zeros(3, 6, dtype=torch.float64, device=device)
        buf[1, 0] = NAN
        ref = buf[1].clone()
        pre = torch.empty(shape, dtype=torch.float32, device=device)
        q, qt, _, _ = launch_quantize(x, scale, fp8, buf[1], precast=pre, transpose=transpose)
        quantize_with_stats_reference(x, scale, fp8, ref)
        _same(buf[1], ref, "statistics row")
        assert buf[1, 0].item() == expected_amax, (buf[1, 0].item(), expected_amax)
        assert buf[1, 4].item() == int((~x.float().isfinite()).sum())
        _same(pre, _expected_precast(x, scale, fp8), "pre-cast values")
        _same(tensor_amax_reference(x), torch.tensor(expected_amax), "tensor_amax_reference")
        if transpose:
            _same_bits(qt, q.t().contiguous(), "transposed output vs q.t()")

    return run


for _f, _d, _s, _fill in [
    ("e4m3", "fp32", "4097", "nan-finite"),
    ("e5m2", "bf16", "4097", "nan-finite"),
    ("e4m3", "fp16", "17", "all-nan"),
    ("e5m2", "fp32", "2048", "inf"),
]:
    case(f"quantize-{_fill}-{_d}-{_f}-{_s}")(_nan_case(_d, _f, _s, _fill, False))
for _f, _d, _s, _fill in [("e4m3", "bf16", "127x129", "nan-finite"), ("e4m3", "fp32", "48x80", "all-nan")]:
    case(f"quantize_transposed-{_fill}-{_d}-{_f}-{_s}")(_nan_case(_d, _f, _s, _fill, True))


@case("quantize-fresh-row-and-large-scale")
def _fresh_row(device: torch.device) -> None:
    from fp8_kernels.triton.quantize import quantize_with_stats_triton

    # no stats row given: a fresh one; a scale so large that finite products overflow to Inf (overflow)
    x = torch.tensor([2.0, -2.0, 0.0, 1e-30, NAN], device=device)
    scale = torch.tensor(torch.finfo(torch.float32).max, device=device)
    for fp8 in FP8.values():
        _, row = quantize_with_stats_triton(x, scale, fp8)
        _, row_ref = quantize_with_stats_reference(x, scale, fp8)
        _same_row(row, row_ref, "statistics row")
        assert row[2:6].tolist() == [3, 0, 1, 5]


@case("quantize-rejects-bad-operands")
def _bad_operands(device: torch.device) -> None:
    from fp8_kernels.triton.quantize import (
        launch_quantize,
        quantize_with_stats_transposed_triton,
        quantize_with_stats_triton,
    )

    x, s = torch.ones(4, device=device), torch.tensor(1.0, device=device)
    bad = [
        (lambda: quantize_with_stats_triton(x, s, torch.float16), "fp8_dtype"),
        (lambda: quantize_with_stats_triton(x.int(), s, torch.float8_e4m3fn), "x:"),
        (
            lambda: quantize_with_stats_triton(x, s, torch.float8_e4m3fn, torch.zeros(6, device=device)),
            "stats",
        ),
        (lambda: quantize_with_stats_transposed_triton(x, s, torch.float8_e4m3fn), "2-D"),
    ]
    for buf in (torch.zeros(4, device=device), torch.zeros(8, device=device)[1:], torch.zeros(8).double()):
        bad.append(  # current scaling's scale_out: too short, misaligned, not float32
            (
                lambda buf=buf: launch_quantize(
                    x, None, torch.float8_e4m3fn, None, amax=s, scale_from_amax=True, scale_out=buf
                ),
                "scale_out",
            )
        )
    parts_bits = torch.tensor([0x3F800000], dtype=torch.int32, device=device)  # 1.0
    for parts, also_amax in (
        (parts_bits.float(), None),  # float, not the int32 bits
        (torch.zeros(0, dtype=torch.int32, device=device), None),  # none at all
        (torch.zeros(4, dtype=torch.int32, device=device)[::2], None),  # not contiguous
        (parts_bits, s),  # and amax as well
    ):
        bad.append(
            (
                lambda parts=parts, also_amax=also_amax: launch_quantize(
                    x, None, torch.float8_e4m3fn, None, amax=also_amax, amax_parts=parts, scale_from_amax=True
                ),
                "amax_parts",
            )
        )
    for fn, word in bad:
        try:
            fn()
        except ValueError as e:
            assert word in str(e), f"message {e!r} does not name {word!r}"
        else:
            raise AssertionError(f"no ValueError for a bad {word}")


# ----- the bias gradient (column sums) in the quantize pass -----
def _dbias_bound(x: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, bound)`` for a kernel's column sums of ``x`` against ``x.float().sum(0)``: both are float32
    sums of the same float32 terms in different orders (the kernel: per program, per thread, a tree across
    threads, then the programs' partials in order; torch: its own cascade). A float32 sum of ``n`` terms in
    any order is within ``(n - 1) * 2**-24 * sum|x|`` of the exact sum (first order; 2**-24 the unit
    roundoff), so the two are within twice that of each other; the kernel's result is then rounded to
    ``x``'s dtype, half an ulp: ``2**-8`` relative for bfloat16, ``2**-11`` for float16, nothing for
    float32. NaN / Inf columns are compared exactly (NaN equal to NaN)."""
    xf = x.double()
    n = x.shape[0]
    exact = xf.sum(0)
    summed = (2 * max(n - 1, 0) * 2.0**-24) * xf.abs().sum(0)
    cast = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(out_dtype, 0.0)
    return exact, summed + cast * (exact.abs() + summed)


def _dbias_case(dtype_name: str, shape_name: str, record: str):
    """``dbias=True`` on the four Triton entries (delayed and current, with and without the transposed
    output): the column sums against ``x.float().sum(0)`` within the float32 summation bound, NaN and Inf
    propagated as in a sum, deterministic (a second call gives the same bits), and everything else the call
    returns exactly what it returns without ``dbias``. ``record``: the statistics into a row of a step
    buffer (``base``: the 6 base columns, ``quality``: all 10) or into a fresh row (``off``)."""

    def run(device: torch.device) -> None:
        from fp8_kernels.triton.current import quantize_current_transposed_triton, quantize_current_triton
        from fp8_kernels.triton.quantize import (
            quantize_with_stats_transposed_triton,
            quantize_with_stats_triton,
        )

        dtype, shape = DTYPES[dtype_name], DBIAS_SHAPES[shape_name]
        fp8 = FP8["e4m3"]
        x = make_input(shape, dtype, fp8, seed=4).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        if shape[1] > 3 and shape[0] > 1:  # a NaN column, an Inf column, a column holding +Inf and -Inf
            x[shape[0] // 2, 1] = NAN
            x[0, 2] = INF
            x[-1, 3], x[0, 3] = INF, -INF
        x = x.to(device)
        scale = torch.tensor(SCALE, device=device)
        entries = {
            "delayed-1d": lambda row, **kw: quantize_with_stats_triton(x, scale, fp8, row, **kw),
            "delayed-2d": lambda row, **kw: quantize_with_stats_transposed_triton(x, scale, fp8, row, **kw),
            "current-1d": lambda row, **kw: quantize_current_triton(x, fp8, row, **kw),
            "current-2d": lambda row, **kw: quantize_current_transposed_triton(x, fp8, row, **kw),
        }
        exact, bound = _dbias_bound(x.cpu(), dtype)
        reference = x.float().sum(0).cpu()
        for how, entry in entries.items():

            def row():
                if record == "off":
                    return None
                buf = torch.zeros(3, 6 if record == "base" else 10, dtype=torch.float64, device=device)
                return buf[1]

            plain = entry(row())
            first = entry(row(), dbias=True)
            assert len(first) == len(plain) + 1, how
            dbias = first[-1]
            assert dbias.dtype == dtype and dbias.shape == (shape[1],) and dbias.device == x.device, how
            if shape_name == "127x20":  # several programs' partials per column: added in a fixed order
                _same(dbias, entry(row(), dbias=True)[-1], f"{how}: dbias of a second call (deterministic)")
            for a, b in zip(first[:-1], plain, strict=True):
                if a.dtype == fp8:
                    _same_bits(a, b, f"{how}: FP8 output with dbias")
                elif a.dim() == 1 and a.dtype == torch.float64:
                    _same_row(a, b, f"{how}: statistics row with dbias")
                else:
                    _same(a, b, f"{how}: {tuple(a.shape)} output with dbias")
            got = dbias.cpu().double()
            finite = torch.isfinite(exact)
            _same(got[~finite], reference.double()[~finite], f"{how}: non-finite columns")
            diff = (got[finite] - reference.double()[finite]).abs()
            assert bool((diff <= bound[finite]).all()), (
                f"{how}: column sums off by {diff.max().item()} (bound {bound[finite][diff.argmax()].item()})"
            )
            if shape[1] > 3 and shape[0] > 1:
                assert torch.isnan(got[1]) and got[2].item() == INF and torch.isnan(got[3]), got[:4]

    return run


DBIAS_SHAPES = {
    "127x129": (127, 129),  # edge tiles on both sides, tokens not a multiple of the tile (or of 16)
    "48x80": (48, 80),  # rows multiples of 16: the transposed output moves 16-bit pairs
    "127x20": (127, 20),  # one tile column: several programs share it (their partials added in order)
    "1x37": (1, 37),  # one token
    "0x7": (0, 7),  # no token: zeros
}
for (
    _d,
    _s,
    _r,
) in [  # the interpreter takes seconds per call: every shape, dtype and row kind, not all crossed
    ("bf16", "127x129", "off"),
    ("bf16", "127x20", "base"),
    ("bf16", "48x80", "quality"),
    ("bf16", "1x37", "base"),
    ("bf16", "0x7", "off"),
    ("fp32", "127x129", "base"),
    ("fp32", "127x20", "quality"),
    ("fp32", "48x80", "off"),
    ("fp32", "1x37", "off"),
]:
    case(f"dbias-{_d}-{_s}-record-{_r}")(_dbias_case(_d, _s, _r))


@case("dbias-rejects-a-tensor-that-is-not-2d")
def _dbias_not_2d(device: torch.device) -> None:
    from fp8_kernels.triton.current import quantize_current_transposed_triton, quantize_current_triton
    from fp8_kernels.triton.quantize import quantize_with_stats_transposed_triton, quantize_with_stats_triton

    scale, fp8 = torch.tensor(1.0, device=device), FP8["e4m3"]
    for x in (torch.ones(5, device=device), torch.ones(2, 3, 4, device=device)):
        for call in (
            lambda x=x: quantize_with_stats_triton(x, scale, fp8, dbias=True),
            lambda x=x: quantize_with_stats_transposed_triton(x, scale, fp8, dbias=True),
            lambda x=x: quantize_current_triton(x, fp8, dbias=True),
            lambda x=x: quantize_current_transposed_triton(x, fp8, dbias=True),
        ):
            try:
                call()
            except ValueError as e:
                assert "dbias" in str(e) and str(tuple(x.shape)) in str(e), e
            else:
                raise AssertionError(f"no ValueError for dbias of shape {tuple(x.shape)}")


# ----- current scaling: amax pass + quantize pass -----
def _current_case(dtype_name: str, fmt: str, shape_name: str, fill: str, transpose: bool = False,
                  pow2: bool = False):  # fmt: skip
    def run(device: torch.device) -> None:
        from fp8_kernels import quantize_current_reference
        from fp8_kernels.triton.current import (
            quantize_current_transposed_triton,
            quantize_current_triton,
            tensor_amax_triton,
        )
        from fp8_trainer.scaling import current_scale

        dtype, fp8, shape = DTYPES[dtype_name], FP8[fmt], SHAPES[shape_name]
        x = make_input(shape, dtype, fp8).to(device)
        if fill == "finite":
            x = torch.nan_to_num(x, nan=0.0, posinf=7.0, neginf=-7.0)
        elif fill == "nan-finite":  # NaN among finite values: the scale comes from the finite ones
            x = torch.nan_to_num(x, nan=0.0, posinf=7.0, neginf=-7.0)
            x.view(-1)[:: max(1, x.numel() // 5)] = NAN
        elif fill == "all-nan":
            x = torch.full_like(x, NAN)
        elif fill == "zeros":
            x = torch.zeros_like(x)
        elif fill == "tiny":
            x = torch.full_like(x, 1e-40 if dtype != torch.float16 else 6e-8)
        _same(tensor_amax_triton(x), tensor_amax_reference(x), "amax")
        amax = tensor_amax_reference(x)
        if fill == "nan-finite":
            assert 0 < amax.item() < INF and amax.item() == x.float().nan_to_num(0.0).abs().max().item()
        scale_ref = current_scale(amax, float(torch.finfo(fp8).max), power_2_scale=pow2)
        if pow2:
            assert math.frexp(scale_ref.item())[0] == 0.5, "not a power of two"
        if fill in ("finite", "nan-finite") and x.numel():
            assert scale_ref.item() != 1.0
        _, row_ref = quantize_with_stats_reference(x, scale_ref, fp8, amax=amax)
        # the dispatch's reference (the CPU path of FP8State) is the same torch ops
        _, scale_disp, sinv_disp, row_disp = quantize_current_reference(
            x, fp8, power_2_scale=pow2, return_scale_inv=True
        )
        _same(scale_disp, scale_ref, "current scale of quantize_current_reference")
        _same(sinv_disp, torch.reciprocal(scale_ref), "scale_inv of quantize_current_reference")
        _same_row(row_disp, row_ref, "statistics row of quantize_current_reference")
        pre = torch.empty(shape, dtype=torch.float32, device=device)
        if transpose:
            # into row 1 of a step buffer, on top of earlier statistics, as a layer's micro-batch does
            buf = torch.zeros(3, 6, dtype=torch.float64, device=device)
            buf[1] = torch.tensor([2.5, 9.0, 1, 2, 3, 40], dtype=torch.float64)
            expected_row = buf[1].clone()
            quantize_with_stats_reference(x, scale_ref, fp8, expected_row, amax=amax)
            q, qt, scale, scale_inv, row = quantize_current_transposed_triton(
                x, fp8, buf[1], precast=pre, power_2_scale=pow2, return_scale_inv=True
            )
            assert row.data_ptr() == buf[1].data_ptr()
            _same(buf[1], expected_row, "accumulated statistics row")
            _same(buf[0] + buf[2], torch.zeros_like(buf[0]), "neighbouring rows")
            assert qt.is_contiguous() and qt.shape == (shape[1], shape[0])
            _same_bits(qt, q.t().contiguous(), "transposed output vs q.t()")
        else:
            q, scale, scale_inv, row = quantize_current_triton(
                x, fp8, precast=pre, power_2_scale=pow2, return_scale_inv=True
            )
            _same_row(row, row_ref, "statistics row")
            # without return_scale_inv: the same scale and row, three outputs
            q3, scale3, row3 = quantize_current_triton(x, fp8, power_2_scale=pow2)
            _same(scale3, scale_ref, "current scale (no scale_inv asked)")
            _same_row(row3, row_ref, "statistics row (no scale_inv asked)")
            _same_bits(q3, q, "FP8 bits (no scale_inv asked)")
        _same(scale, scale_ref, "current scale")
        # the quantize pass writes the GEMM's scale_inv: torch.reciprocal's bits, 16-byte aligned as cuBLASLt
        # needs its scale pointers (fp8_trainer.gemm.check_scaled_mm_args)
        _same(scale_inv, torch.reciprocal(scale_ref), "scale_inv")
        assert scale.dim() == scale_inv.dim() == 0 and scale_inv.dtype == torch.float32
        assert scale.data_ptr() % 16 == 0 and scale_inv.data_ptr() % 16 == 0, "scale / scale_inv alignment"
        _same(pre, _expected_precast(x, scale_ref, fp8), "pre-cast values")
        _same_bits(q, pre.to(fp8), "FP8 bits vs torch cast of the pre-cast values")

    return run


for _d in DTYPES:
    for _s in ("17", "127x129", "4097", "empty"):
        case(f"current-{_d}-e4m3-{_s}-finite")(_current_case(_d, "e4m3", _s, "finite"))
    case(f"current-{_d}-e5m2-4097-nonfinite")(_current_case(_d, "e5m2", "4097", "nonfinite"))
    case(f"current-{_d}-e4m3-17-zeros")(_current_case(_d, "e4m3", "17", "zeros"))
    case(f"current-{_d}-e5m2-17-tiny")(_current_case(_d, "e5m2", "17", "tiny"))
    case(f"current-{_d}-e4m3-4097-nan-finite")(_current_case(_d, "e4m3", "4097", "nan-finite"))
    case(f"current-{_d}-e5m2-2048-finite-pow2")(_current_case(_d, "e5m2", "2048", "finite", pow2=True))


@case("current-amax-from-every-program")
def _current_amax_from_every_program(device: torch.device) -> None:
    """The amax pass leaves one partial maximum per program and the quantize pass reduces them all: the
    tensor's maximum is put in each block (and the tail) in turn, so that every program holds it once."""
    from fp8_kernels.triton.current import amax_pass, quantize_current_triton
    from fp8_kernels.triton.launch import block_1d, grid_cap
    from fp8_trainer.scaling import current_scale

    block, _ = block_1d(device)
    programs = grid_cap(device)
    n = block * (programs + 1) + 5  # a block for every program, a second for one of them, and a tail
    x = torch.linspace(-1.0, 1.0, n, device=device)
    holders = set()
    for pos in [*(b * block + 7 for b in range(programs + 1)), n - 1]:
        x[pos] = -300.0
        parts, _ = amax_pass(x)
        assert parts.dtype == torch.int32 and parts.numel() == programs, (parts.dtype, parts.shape)
        holders.add(int(parts.argmax()))
        amax = tensor_amax_reference(x)
        _same(parts.max().view(torch.float32), amax, f"largest partial maximum, maximum at {pos}")
        q, scale, scale_inv, row = quantize_current_triton(x, torch.float8_e4m3fn, return_scale_inv=True)
        _same(scale, current_scale(amax, 448.0), f"scale, maximum at {pos}")
        _same(scale_inv, torch.reciprocal(scale), f"scale_inv, maximum at {pos}")
        assert row[0].item() == 300.0, row[0].item()
        x[pos] = 0.0
    assert holders == set(range(programs)), f"partials holding the maximum: {sorted(holders)}"
    # an Inf in one program's share and a NaN in another's: the Inf is the amax, the scale falls back to 1
    x[7], x[block + 7] = INF, NAN
    q, scale, row = quantize_current_triton(x, torch.float8_e4m3fn)
    assert scale.item() == 1.0 and row[0].item() == INF, (scale.item(), row[0].item())


case("current-fp32-e4m3-17-all-nan")(_current_case("fp32", "e4m3", "17", "all-nan"))
case("current-fp32-e5m2-17-tiny-pow2")(_current_case("fp32", "e5m2", "17", "tiny", pow2=True))
for _d, _f, _s, _fill, _pow2 in [
    ("fp32", "e4m3", "127x129", "finite", False),
    ("bf16", "e4m3", "127x129", "finite", False),
    ("fp16", "e4m3", "127x129", "finite", False),
    ("fp32", "e5m2", "127x129", "nonfinite", False),
    ("bf16", "e4m3", "0x7", "finite", False),
    ("bf16", "e4m3", "48x80", "finite", False),
    ("fp32", "e4m3", "64x96", "nan-finite", False),
    ("bf16", "e4m3", "48x80", "nan-finite", True),
    ("fp16", "e5m2", "127x129", "finite", True),
]:
    _name = f"current_transposed-{_d}-{_f}-{_s}-{_fill}" + ("-pow2" if _pow2 else "")
    case(_name)(_current_case(_d, _f, _s, _fill, transpose=True, pow2=_pow2))


# ----- exponent histogram -----
def _histogram_case(dtype_name: str, shape_name: str):
    def run(device: torch.device) -> None:
        from fp8_kernels.triton.histogram import exponent_histogram_triton

        dtype, shape = DTYPES[dtype_name], SHAPES[shape_name]
        n = math.prod(shape)
        g = torch.Generator().manual_seed(2)
        # every float32 exponent from the smallest subnormal to the largest finite
        decades = torch.logspace(-46, 38.5, max(n, 1), dtype=torch.float64)[:n]
        x = torch.randn(n, generator=g, dtype=torch.float64) * decades
        specials = [0.0, -0.0, NAN, INF, -INF, 2.0**-149, -(2.0**-140), 2.0**127, 1.0, -0.75]
        k = min(n, len(specials))
        x[:k] = torch.tensor(specials[:k], dtype=torch.float64)
        x = x.to(dtype).reshape(shape).to(device)
        counts = exponent_histogram_triton(x)
        _same(counts, exponent_histogram_reference(x), "histogram")
        assert int(counts.sum()) == n

    return run


for _d in DTYPES:
    for _s in SHAPES:
        case(f"histogram-{_d}-{_s}")(_histogram_case(_d, _s))


# ----- fused scale update -----
def _settings(device: torch.device):
    """Ten tensors, each with other settings, the first five E4M3 and the rest E5M2."""
    t = dict(device=device)
    return dict(
        fp8_max=torch.tensor([448.0] * 5 + [57344.0] * 5, **t),
        margin=torch.tensor([0, 1, 0.5, 2, 0, 0, 0, 3, 0, 1.0], **t),
        most_recent=torch.tensor([0, 1, 0, 1, 0, 0, 1, 0, 1, 0], dtype=torch.bool, **t),
        history_len=torch.tensor([7, 3, 7, 1, 5, 7, 2, 7, 4, 6], **t),
        interval=torch.tensor([1, 1, 2, 1, 3, 1, 1, 2, 1, 1], **t),
        enabled=torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0, 1], dtype=torch.bool, **t),
    )


@case("scale_update-ten-tensors-six-steps")
def _scale_update(device: torch.device) -> None:
    from fp8_kernels import SCALE_STRIDE, is_aligned_scale
    from fp8_kernels.triton.scale_update import scale_update_triton
    from fp8_trainer.scaling import delayed_scaling_update

    s = _settings(device)
    g = torch.Generator().manual_seed(3)
    hist = (torch.rand(7, 10, generator=g) * 10).to(device)
    scale = (torch.rand(10, generator=g) + 0.5).to(device)
    # per step: zero, NaN, Inf, a tiny amax (448 / 1e-42 overflows: clamped), ordinary values
    amaxes = [
        [1.0, 0.0, 2.0, NAN, 3.0, INF, 1e-42, 5.0, 6.0, 7.0],
        [2.0, 4.0, NAN, 1.0, 0.0, 2.0, 3.0, 1e-30, 6.0, 0.5],
        [0.5, INF, 8.0, 9.0, 1.5, 0.0, 4.0, 2.0, 1.0, NAN],
        [3.0, 1.0, 1.0, 2.0, 2.5, 1.0, 0.0, 7.0, 2.0, 3.0],
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0],
        [9.0, 0.25, 1.0, 1e-38, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
    ]
    hist_ref, scale_ref, scale0, hist0 = hist.clone(), scale.clone(), scale.clone(), hist.clone()
    for step, values in enumerate(amaxes, start=1):
        if step == 4:  # settings changed in place: the kernel's cached fp8_max * 2**-margin must follow
            s["margin"].add_(1.0)
        # the amax column of a float64 step statistics buffer, strided, as end_step passes it
        stats = torch.zeros(10, 6, dtype=torch.float64, device=device)
        stats[:, 0] = torch.tensor(values, dtype=torch.float64)
        step_t = torch.tensor(step, device=device)
        # from step 2 on the scale going in is the last call's aligned (strided) vector
        assert step == 1 or scale.stride(0) == SCALE_STRIDE
        hist, scale, scale_inv = scale_update_triton(hist, stats[:, 0], scale, step=step_t, **s)
        assert hist.is_contiguous() and scale.stride(0) == scale_inv.stride(0) == SCALE_STRIDE
        assert all(is_aligned_scale(scale[i]) and is_aligned_scale(scale_inv[i]) for i in range(10))
        hist_ref, scale_ref = delayed_scaling_update(
            hist_ref, stats[:, 0].to(torch.float32), scale_ref, fp8_max=s["fp8_max"], margin=s["margin"],
            amax_compute_algo=s["most_recent"], history_len=s["history_len"], interval=s["interval"],
            step=step_t, update=s["enabled"],
        )  # fmt: skip
        _same(hist, hist_ref, f"history after step {step}")
        _same(scale, scale_ref, f"scale after step {step}")
        _same(scale_inv, torch.reciprocal(scale_ref), f"scale_inv after step {step}")
        if step == 1:  # the grid does reach the edge cases
            assert scale[6].item() == torch.finfo(torch.float32).max  # tiny amax: clamped
            assert scale[1].item() == scale0[1].item() and scale[3].item() == scale0[3].item()  # zero, NaN
            assert scale[8].item() == scale0[8].item() and scale[0].item() != scale0[0].item()
            _same(hist[:, 1], hist0[:, 1], "history of the tensor whose amax was 0 (no roll)")
            assert math.isnan(hist[0, 3].item())  # a NaN amax rolls (TE: NaN != 0)
        if step == 2:  # "max" over a window holding a NaN: the NaN is ignored (margin 0.5, due at step 2)
            assert scale[2].item() != scale0[2].item()


def _scale_update_long(n: int):
    def run(device: torch.device) -> None:
        from fp8_kernels.triton.scale_update import scale_update_triton
        from fp8_trainer.scaling import delayed_scaling_update

        length = 67  # several row chunks and column blocks
        g = torch.Generator().manual_seed(4)
        hist = (torch.rand(length, n, generator=g) * 100).to(device)
        hist[5, ::3] = NAN  # NaN inside the windows: ignored by the max
        amax = torch.rand(n, generator=g) * 1000
        amax[::5] = 0.0  # idle tensors: no roll, scale kept
        amax = amax.to(device)
        scale = torch.ones(n, device=device)
        kw = dict(
            fp8_max=torch.full((n,), 448.0, device=device),
            margin=torch.zeros(n, device=device),
            history_len=torch.randint(1, length + 1, (n,), generator=g).to(device),
            interval=torch.ones(n, dtype=torch.int64, device=device),
        )
        recent = (torch.arange(n) % 4 == 0).to(device)
        enabled = torch.ones(n, dtype=torch.bool, device=device)
        step = torch.tensor(1, device=device)
        h, s, _ = scale_update_triton(hist, amax, scale, most_recent=recent, step=step, enabled=enabled, **kw)
        h_ref, s_ref = delayed_scaling_update(
            hist, amax, scale, amax_compute_algo=recent, step=step, update=enabled, **kw
        )
        _same(h, h_ref, "history")
        _same(s, s_ref, "scale")
        _same(h[:, ::5], hist[:, ::5], "histories of the idle tensors")

    return run


# 37: neither a multiple of the block nor of 16; 48: the aligned specialisation (DIV_N 16)
for _n in (37, 48):
    case(f"scale_update-long-history-{_n}")(_scale_update_long(_n))


# ----- the kernels inside FP8 training (interpreter: registered for the CPU) -----
@case("fp8_linear-training-step-uses-kernels", devices=("cpu",))
def _training_step(device: torch.device) -> None:
    from torch import nn

    import fp8_kernels
    import fp8_trainer
    from fp8_kernels.triton.current import tensor_amax_triton
    from fp8_kernels.triton.histogram import exponent_histogram_triton
    from fp8_kernels.triton.quantize import quantize_with_stats_transposed_triton, quantize_with_stats_triton
    from fp8_kernels.triton.scale_update import scale_update_triton
    from fp8_trainer.convert import get_fp8_state
    from fp8_trainer.scaling import delayed_scaling_update

    calls: list[str] = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    fp8_kernels.register(
        "cpu",
        quantize=counted("quantize", quantize_with_stats_triton),
        quantize_transposed=quantize_with_stats_transposed_triton,
        amax=tensor_amax_triton,
        histogram=exponent_histogram_triton,
        scale_update=counted("scale_update", scale_update_triton),
    )
    try:
        torch.manual_seed(0)
        model = fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 16)))
        state = get_fp8_state(model)
        x = torch.randn(9, 32)
        hist0, scale0 = state.amax_history.clone(), state.scale.clone()
        with fp8_trainer.fp8_autocast():
            loss = model(x).square().mean()
        loss.backward()
        assert calls.count("quantize") == 6 and calls.count("scale_update") == 1, calls
        stats = fp8_trainer.step_stats(model)
        # input and weight of the first layer: rows equal to the reference on the same tensors
        _, row_x = quantize_with_stats_reference(x, scale0[0], torch.float8_e4m3fn)
        _, row_w = quantize_with_stats_reference(model[0].weight.detach(), scale0[1], torch.float8_e4m3fn)
        _same_row(stats[0], row_x, "input statistics")
        _same_row(stats[1], row_w, "weight statistics")
        h_ref, s_ref = delayed_scaling_update(
            hist0, stats[:, 0].to(torch.float32), scale0, fp8_max=state.fp8_max, margin=state.margin,
            amax_compute_algo=state.most_recent, history_len=state.history_len, interval=state.interval,
            step=1, update=state.enabled_t,
        )  # fmt: skip
        _same(state.amax_history, h_ref, "history after the step")
        _same(state.scale, s_ref, "scales after the step")
        with fp8_kernels.reference_kernels():
            fp8_kernels.quantize_with_stats(x, scale0[0], torch.float8_e4m3fn)
        assert calls.count("quantize") == 6, "use_reference did not bypass the registered kernel"
    finally:
        fp8_kernels.register("cpu")


@case("bench_kernels-smoke", devices=("cpu",))
def _bench_smoke(device: torch.device) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # as when run as a script: its sibling modules (gpu_timing) import
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kernels.json"
        assert mod.main(["--smoke", "--out", str(out)]) == 0
        data = json.loads(out.read_text())
    # the JSON in the layout scripts/gpu-check.sh reads (its numbers are not measurements here)
    assert data["meta"]["smoke"] is True and isinstance(data["summary"], str) and data["summary"]
    rows = data["rows"]
    assert [r["numel"] for r in rows] == [2**10, 2**12]
    for r in rows:
        assert all(r["stats_match_eager"].values()), r["stats_match_eager"]
        assert {"triton-pipe", "triton+T-pipe"} <= set(r["stats_match_eager"])  # the pipelined loads too
        impls = ("copy", "triton", "eager", "compile", "triton+T", "eager+T", "triton-pipe", "triton+T-pipe")
        for impl in impls:
            assert r[impl]["ms"] > 0 and r[impl]["gbps"] > 0 and r[impl]["calls_per_sample"] >= 1, impl
        for impl in ("triton", "eager", "compile", "triton+T"):
            assert r[impl]["fraction_of_copy"] > 0, r
        # the host's time to issue the calls, beside their time: on the CPU both are the wall clock, so every
        # row is marked as measuring the launcher
        assert all(r[impl]["host_ms"] > 0 for impl in impls) and r["launch_bound"] is True, r
    assert data["correct"] is True
    assert set(data["goals"]) == {
        "triton_80pct_of_copy", "triton_T_80pct_of_copy", "triton_2x_eager", "triton_T_2x_eager"
    }  # fmt: skip
    for g in data["goals"].values():
        assert isinstance(g["met"], bool) and g["met"] == (g["value"] >= g["target"]), g
    assert "back-to-back" in data["meta"]["timing"] and data["meta"]["copy_gbps"] > 0


# ----- runner -----
def run_all(device: torch.device, names: list[str]) -> dict[str, dict]:
    results = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            CASES[name][0](device)
            error = None
        except Exception:
            error = traceback.format_exc(limit=6)
        results[name] = {"error": error, "seconds": round(time.perf_counter() - t0, 3)}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run the kernel cases under the Triton interpreter")
    p.add_argument("--json", required=True, help="where to write {case: {error, seconds}}")
    p.add_argument("--only", default="", help="comma-separated case names (default: all CPU cases)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "kernel_cases: set TRITON_INTERPRET=1 (Triton kernels run on the CPU only interpreted)",
            file=sys.stderr,
        )
        return 2
    names = a.only.split(",") if a.only else case_names("cpu")
    results = run_all(torch.device("cpu"), names)
    Path(a.json).write_text(json.dumps(results, indent=1))
    failed = [n for n, r in results.items() if r["error"]]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed: {failed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
