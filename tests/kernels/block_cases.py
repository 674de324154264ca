"""The block-scaled quantize kernel (``triton.block_quantize``) against ``quantize_blocks`` and the statistics
of ``fp8_trainer.block_linear``, one case per recipe, input dtype and FP8 format; shared by the CPU test
(``TRITON_INTERPRET=1``, in a subprocess: ``python -m tests.kernels.block_cases --json OUT`` from the
repository root; ``test_block_interpreted.py``) and the GPU test (compiled, in-process;
``test_triton_block_quantize.py``).

Exact: the FP8 bits (the kernel rounds arithmetically before its cast, so the interpreter's float8 cast
cannot differ), ``scale_inv``'s bits, and every column of the statistics row and block row the kernel
merges (counts, amax and its scale, ``min_abs``, block counts, dynamic range, histogram) except the two
sums of squares, which are float64 sums of the same exact float64 terms in another order
(``exact_checks.same_row``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch

from fp8_kernels.reference.block_quantize import block_stats, quantize_blocks
from fp8_trainer.block_linear import BlockSpec, new_block_stats, record_block_stats
from tests.kernels.exact_checks import same, same_bits, same_row

NAN, INF = float("nan"), float("inf")
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: name -> (block, scale_format, shape): sizes not multiples of the block (partial edge blocks), a row
#: count not a multiple of the interpreter's 16-row tile
RECIPES = {
    "mx1x32": ((1, 32), "e8m0", (21, 80)),
    "fp1x128": ((1, 128), "fp32", (19, 200)),
    "mx32x32": ((32, 32), "e8m0", (40, 136)),
    "fp128x128": ((128, 128), "fp32", (130, 400)),
}

CASES: dict = {}


def case(name):
    def deco(fn):
        CASES[name] = fn
        return fn

    return deco


def make_blocks(shape, block, dtype, fp8, seed=0) -> torch.Tensor:
    """Random values over many decades, then hand-built blocks (the first, in row-major order): an
    all-zero block; one huge value among ordinary ones; NaN; +-Inf; values whose scaled result lands in
    the FP8 subnormal range or below it (with a -0.0 and a subnormal of the input dtype); an all-NaN block;
    a block of only the input dtype's largest finite value."""
    m, n = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g) * torch.logspace(-8, 6, n)[None, :]
    bm, bn = block
    top = float(torch.finfo(dtype).max)
    fi = torch.finfo(fp8)
    min_sub = float(fi.smallest_normal) * float(fi.eps)
    specials = [
        lambda r: r.zero_(),
        lambda r: r[:, 3].fill_(top),
        lambda r: r[:, 1].fill_(NAN),
        lambda r: (r[:, 0].fill_(INF), r[:, 5].fill_(-INF)),
        lambda r: (
            r.fill_(1.0),
            r[:, 1].fill_(3 * min_sub / float(fi.max)),  # scaled by about FP8_MAX: a subnormal
            r[:, 2].fill_(0.2 * min_sub / float(fi.max)),  # below half the smallest subnormal: zero
            r[:, 4].fill_(-0.0),
            r[:, 6].fill_(float(torch.finfo(dtype).tiny) / 4),
        ),
        lambda r: r.fill_(NAN),
        lambda r: r.fill_(top),
    ]
    gn = -(-n // bn)
    for k, fill in enumerate(specials):  # the k-th block in row-major order
        i, j = divmod(k, gn)
        if i * bm >= m:
            break
        fill(x[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn])
    return x.to(dtype)


def new_rows(device, quality: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh statistics row (``min_abs`` +inf) and block row, as a step starts them."""
    stats = torch.zeros(10 if quality else 6, dtype=torch.float64, device=device)
    if quality:
        stats[9] = INF
    return stats, new_block_stats(1, device)[0]


def check(device, recipe, dtype_name, fp8_name, *, power_2_scale=True, amax_epsilon=0.0, seed=0):
    """The kernel's FP8 bits and ``scale_inv`` against ``quantize_blocks``; the statistics it merges into a
    step's rows over three calls (the amax rising, then falling: the scale column is the largest amax's)
    against ``record_block_stats`` from the reference, with and without the quality columns."""
    from fp8_kernels.triton.block_quantize import block_quantize_triton

    block, fmt, shape = RECIPES[recipe]
    fp8, dtype = FP8[fp8_name], DTYPES[dtype_name]
    x = make_blocks(shape, block, dtype, fp8, seed).to(device)
    kw = dict(power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
    spec = BlockSpec(fmt, block[1], two_d=block[0] > 1, **kw)
    calls = [x * 0.25, x, x * 0.5]
    for quality in (True, False):
        stats, block_row = new_rows(device, quality)
        stats_ref, block_row_ref = new_rows(device, quality)
        for i, xi in enumerate(calls):
            q = block_quantize_triton(xi, fp8, block, fmt, stats=stats, block_stats=block_row, **kw)
            ref = quantize_blocks(xi, fp8, block, fmt, **kw)
            same_bits(q.data, ref.data, f"FP8 data (call {i})")
            same_bits(q.scale_inv.contiguous(), ref.scale_inv, f"scale_inv (call {i})")
            assert q.block == ref.block and q.scale_format == ref.scale_format
            record_block_stats(xi, ref, fp8, spec, stats_ref, block_row_ref)
            same_row(stats, stats_ref, f"statistics row after call {i} (quality {quality})")
            same(block_row, block_row_ref, f"block row after call {i} (quality {quality})")
    # without rows: the same bits, no statistics
    q = block_quantize_triton(x, fp8, block, fmt, **kw)
    ref = quantize_blocks(x, fp8, block, fmt, **kw)
    same_bits(q.data, ref.data, "FP8 data (no statistics)")
    same_bits(q.scale_inv.contiguous(), ref.scale_inv, "scale_inv (no statistics)")
    # the hand-built blocks really are in the tensor: an all-zero block, non-finite ones, saturation
    bs = block_stats(x, ref, fp8)
    assert int(bs["zero_blocks"]) >= 1 and int(bs["nonfinite_blocks"]) >= 1
    assert int(bs["overflow"].sum()) + int(bs["underflow"].sum()) >= 1


for _recipe in RECIPES:
    for _dt in DTYPES:
        for _f in FP8:
            case(f"{_recipe}-{_dt}-{_f}")(lambda device, r=_recipe, d=_dt, f=_f: check(device, r, d, f))


@case("fp1x128-no-pow2-epsilon")
def _fp32_options(device):
    check(device, "fp1x128", "bf16", "e4m3", power_2_scale=False)
    check(device, "fp1x128", "fp32", "e5m2", power_2_scale=False, amax_epsilon=1e-3)
    check(device, "fp128x128", "fp16", "e4m3", power_2_scale=True, amax_epsilon=2.0**-10)


@case("empty-and-tiny")
def _empty_and_tiny(device):
    from fp8_kernels.triton.block_quantize import block_quantize_triton

    for shape in ((0, 64), (1, 1), (3, 33)):
        x = torch.randn(shape).to(device)
        for block, fmt in (((1, 32), "e8m0"), ((128, 128), "fp32")):
            stats, block_row = new_rows(device, True)
            q = block_quantize_triton(x, FP8["e4m3"], block, fmt, stats=stats, block_stats=block_row)
            ref = quantize_blocks(x, FP8["e4m3"], block, fmt)
            same_bits(q.data, ref.data, f"FP8 data {shape}")
            same_bits(q.scale_inv.contiguous(), ref.scale_inv, f"scale_inv {shape}")
            stats_ref, block_row_ref = new_rows(device, True)
            if x.numel():  # an empty tensor records nothing
                spec = BlockSpec(fmt, block[1], two_d=block[0] > 1)
                record_block_stats(x, ref, FP8["e4m3"], spec, stats_ref, block_row_ref)
            same_row(stats, stats_ref, f"statistics row {shape}")
            same(block_row, block_row_ref, f"block row {shape}")


@case("transposed-input")
def _transposed_input(device):
    """The transpose of a row-major tensor (a column-wise copy's input) is read in place: the same bits and
    statistics as the reference's."""
    from fp8_kernels.triton.block_quantize import block_quantize_triton

    for recipe in ("mx1x32", "fp1x128", "mx32x32"):
        block, fmt, (m, n) = RECIPES[recipe]
        x = make_blocks((n, m), block, torch.bfloat16, FP8["e4m3"]).to(device).t()  # (m, n), strides (1, m)
        assert not x.is_contiguous()
        stats, block_row = new_rows(device, True)
        q = block_quantize_triton(x, FP8["e4m3"], block, fmt, stats=stats, block_stats=block_row)
        ref = quantize_blocks(x, FP8["e4m3"], block, fmt)
        same_bits(q.data, ref.data, f"{recipe}: FP8 data of a transposed input")
        same_bits(q.scale_inv.contiguous(), ref.scale_inv, f"{recipe}: scale_inv of a transposed input")
        stats_ref, block_row_ref = new_rows(device, True)
        spec = BlockSpec(fmt, block[1], two_d=block[0] > 1)
        record_block_stats(x, ref, FP8["e4m3"], spec, stats_ref, block_row_ref)
        same_row(stats, stats_ref, f"{recipe}: statistics row of a transposed input")
        same(block_row, block_row_ref, f"{recipe}: block row of a transposed input")


def check_block_linear(device, scaling: str) -> None:
    """``fp8_trainer.block_linear.quantize_block_tensor`` through the dispatch with the kernel registered for
    ``device`` (on CUDA it registers itself; on the CPU this case registers it for the call) against the
    reference path: the same FP8 copies, statistics row and block part, for every role's spec."""
    import fp8_kernels
    from fp8_kernels.triton.block_quantize import block_quantize_triton
    from fp8_trainer.block_linear import BLOCK_WIDTH, block_specs, quantize_block_tensor
    from fp8_trainer.recipe import DelayedScaling

    if device.type == "cpu":
        fp8_kernels.register("cpu", block_quantize=block_quantize_triton)
    try:
        assert fp8_kernels.has_kernel("block_quantize", device.type)
        x = make_blocks((64, 160), (1, 32), torch.bfloat16, FP8["e4m3"]).to(device)
        for spec in block_specs(scaling, DelayedScaling()):
            runs = []
            for reference in (False, True):
                stats = torch.zeros(10, dtype=torch.float64, device=device)
                stats[9] = INF
                block_row = torch.zeros(BLOCK_WIDTH, dtype=torch.float64, device=device)
                previous = fp8_kernels.use_reference(reference)
                try:
                    row, col = quantize_block_tensor(
                        x, FP8["e4m3"], spec, rowwise=True, columnwise=True, stats=stats,
                        block_stats_row=block_row,
                    )  # fmt: skip
                finally:
                    fp8_kernels.use_reference(previous)
                runs.append((row, col, stats, block_row))
            (row, col, stats, block_row), (row_r, col_r, stats_r, block_row_r) = runs
            same_bits(row.data, row_r.data, f"{spec}: row-wise FP8")
            same_bits(col.data, col_r.data, f"{spec}: column-wise FP8")
            # flattened: a transposed (n, 1) scale_inv has a stride torch's bit view refuses
            same_bits(row.scale_inv.flatten(), row_r.scale_inv.flatten(), f"{spec}: row-wise scale_inv")
            same_bits(col.scale_inv.flatten(), col_r.scale_inv.flatten(), f"{spec}: column-wise scale_inv")
            same_row(stats, stats_r, f"{spec}: statistics row")
            same(block_row, block_row_r, f"{spec}: block part")
            assert float(block_row[0]) == row.scale_inv.numel() and float(stats[4]) > 0
    finally:
        if device.type == "cpu":
            fp8_kernels.register("cpu")


for _scaling in ("mxfp8", "block"):
    case(f"block-linear-{_scaling}")(lambda device, s=_scaling: check_block_linear(device, s))


def case_names() -> list[str]:
    return list(CASES)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("block_cases: run with TRITON_INTERPRET=1 (the CPU runner)", file=sys.stderr)
        return 2
    results = {}
    for name in args.only or case_names():
        try:
            CASES[name](torch.device("cpu"))
            results[name] = {"error": None}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    args.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
