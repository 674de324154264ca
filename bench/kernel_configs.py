"""Launch configurations of the fused quantize kernels, side by side on one GPU: which block / tile size,
warps, grid size and form of the main loop's loads move the most bytes per second, each checked bit for bit
against the PyTorch reference.

The configuration is what ``fp8_kernels.triton.launch`` chooses (``block_1d``, ``tile_2d``, ``grid_cap``,
``prefetch`` and ``pipeline_stages``);
this script swaps those functions for each candidate, the way ``tests/kernels/test_ptx.py`` does, so the
kernels themselves are the shipped ones. Shapes are activation- and gradient-sized bf16 tensors of the GPT
benchmark and of the Linear goal shape (each several times the L2 with rotating inputs); bandwidth counts an
ideal implementation's bytes: bf16 read, FP8 written (twice for the transposed kernel), against a copy of
the same tensor measured in the same run.

    python bench/kernel_configs.py [--reps 5] [--out bench/results/kernel_configs.json]
    python bench/kernel_configs.py --smoke   # CPU, TRITON_INTERPRET=1, tiny shapes: exercises the script
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from gpu_common import write_json
from gpu_timing import ms_per_call

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kernels.exact_checks import same_row  # the kernel tests' rule for a statistics row

SHAPES_1D = [(16384, 3072)]
SHAPES_2D = [(16384, 768), (8192, 14336)]
SMOKE_SHAPES = [(48, 80)]
# (BLOCK, num_warps); (BLOCK_M, BLOCK_N, num_warps), narrowed from an H200 sweep over (4096, 8), (2048, 4),
# (4096, 4), (8192, 8) and (128, 64, 16), (64, 64, 8), (64, 64, 4), (128, 64, 8), (64, 128, 8) whose best
# were (4096, 8), (64, 64, 4) for 16384 x 768 and (128, 64, 16) for 8192 x 14336; programs per SM of the
# persistent grid
CONFIGS_1D = [(4096, 8), (2048, 4)]
CONFIGS_2D = [(128, 64, 16), (64, 64, 8), (64, 64, 4)]
PROGRAMS_PER_SM = [4, 8]
# the main loop's loads: (name, prefetch, pipeline_stages): the register prefetch (the next block loaded
# into registers before the current one is worked on; the plain loop lost to it in 23 of 28 pairs on an
# H200), or Triton's software pipeline (asynchronous copies into shared memory, stages - 1 blocks ahead)
LOADS = [("prefetch", True, 1), ("pipeline x3", False, 3), ("pipeline x4", False, 4)]
FP8 = torch.float8_e4m3fn


class Bench(NamedTuple):
    """One run's fixed parts: the device, its L2 size and SM count, the scale every call quantizes with,
    the configuration shipped (``block_1d``, ``tile_2d``, ``grid_cap``, ``prefetch``, ``pipeline_stages``)
    and the command line's reps and smoke flag."""

    device: torch.device
    l2: int
    sms: int
    scale: torch.Tensor
    shipped: tuple
    reps: int
    smoke: bool


def setup(a: argparse.Namespace) -> Bench:
    """The device's properties and the shipped configuration, read before any candidate replaces it."""
    from fp8_kernels.triton import launch as triton_launch

    device = torch.device("cpu" if a.smoke else "cuda")
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    shipped = (
        triton_launch.block_1d(device),
        triton_launch.tile_2d(device),
        triton_launch.grid_cap(device),
        triton_launch.prefetch(device),
        triton_launch.pipeline_stages(device),
    )
    return Bench(
        device,
        props.L2_cache_size if props else 0,
        props.multi_processor_count if props else 1,
        torch.tensor(3.7, device=device),
        shipped,
        a.reps,
        a.smoke,
    )


def timed(b: Bench, fn, n_bufs: int) -> float:
    """ms per call of ``fn(i)``, median of ``reps`` samples of ``4 * n_bufs`` calls; in a smoke run one
    call and NaN (the interpreter's time says nothing)."""
    if b.smoke:
        fn(0)
        return float("nan")
    for i in range(3):
        fn(i)
    return statistics.median(ms_per_call(fn, 4 * n_bufs, b.device) for _ in range(b.reps))


def install(b: Bench, transpose: bool, cfg: tuple, per_sm: int, prefetch: bool, stages: int) -> None:
    """Swap the launch choices the quantize kernels read for one candidate's (the kernels stay the shipped
    ones); the CPU keeps small fixed ones the interpreter walks quickly."""
    from fp8_kernels.triton import launch as triton_launch
    from fp8_kernels.triton import quantize as triton_quantize

    if transpose:
        triton_quantize.tile_2d = lambda dev, c=cfg: c if dev.type == "cuda" else (16, 16, 4)
    else:
        triton_quantize.block_1d = lambda dev, c=cfg: c if dev.type == "cuda" else (64, 4)
    triton_launch.grid_cap = lambda dev, k=per_sm: k * b.sms if dev.type == "cuda" else 3
    triton_quantize.prefetch = lambda dev, f=prefetch: f
    triton_quantize.pipeline_stages = lambda dev, k=stages: k


def is_exact(b: Bench, x: torch.Tensor, q_ref: torch.Tensor, row_ref: torch.Tensor, transpose: bool) -> bool:
    """One call of the installed candidate against the reference: the statistics exactly, but for the two
    float32 sums of squares (within their bound); the FP8 bits on a GPU only (the interpreter's own cast is
    not the hardware's)."""
    from fp8_kernels.triton import quantize as triton_quantize

    q, qt, row, _ = triton_quantize.launch_quantize(x, b.scale, FP8, None, transpose=transpose)
    try:
        same_row(row, row_ref, "statistics row")
        exact = True
    except AssertionError:
        exact = False
    if b.device.type == "cuda":
        exact = exact and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        if transpose:
            exact = exact and torch.equal(qt.view(torch.uint8), q_ref.t().contiguous().view(torch.uint8))
    return exact


def candidates(b: Bench, configs: list[tuple]) -> list[tuple]:
    """Every (config, programs per SM, loads) to try; the smoke run keeps one config and one grid size."""
    if b.smoke:
        return list(itertools.product(configs[:1], [4], LOADS))
    return list(itertools.product(configs, PROGRAMS_PER_SM, LOADS))


def bench_shape(b: Bench, m: int, n: int, transpose: bool, configs: list[tuple]) -> list[dict]:
    """Every candidate on one ``m x n`` shape: checked, timed over rotating inputs, against a copy."""
    from fp8_kernels import quantize_with_stats_reference
    from fp8_kernels.triton import quantize as triton_quantize

    n_bufs = 2 if b.smoke else max(2, math.ceil(4 * b.l2 / (2 * m * n)))
    g = torch.Generator(device=b.device).manual_seed(m + n)
    xs = [(torch.randn(m, n, generator=g, device=b.device) * 40).to(torch.bfloat16) for _ in range(n_bufs)]
    q_ref, row_ref = quantize_with_stats_reference(xs[0], b.scale, FP8, None)
    outs = [torch.empty_like(x) for x in xs]
    copy_ms = timed(b, lambda i: outs[i % n_bufs].copy_(xs[i % n_bufs]), n_bufs)
    copy_gbs = 4 * m * n / (copy_ms * 1e-3) / 1e9
    useful = (4 if transpose else 3) * m * n
    results = []
    for cfg, per_sm, (loads, pre, stages) in candidates(b, configs):
        install(b, transpose, cfg, per_sm, pre, stages)
        try:
            exact = is_exact(b, xs[0], q_ref, row_ref, transpose)
            ms = timed(
                b,
                lambda i: triton_quantize.launch_quantize(
                    xs[i % n_bufs], b.scale, FP8, None, transpose=transpose
                ),
                n_bufs,
            )
            err = None
        except Exception as e:  # a configuration that does not compile or run: say so, go on
            exact, ms, err = False, float("nan"), f"{type(e).__name__}: {e}"[:300]
        gbs = useful / (ms * 1e-3) / 1e9
        res = {
            "kernel": "transposed" if transpose else "1-D",
            "shape": f"{m}x{n}",
            "config": list(cfg),
            "programs_per_sm": per_sm,
            "loads": loads,
            "ms": ms,
            "GB/s": gbs,
            "of_copy": gbs / copy_gbs,
            "exact": exact,
            "shipped": is_shipped(b, transpose, cfg, per_sm, pre, stages),
            "error": err,
        }
        results.append(res)
        print_result(res, copy_gbs)
    return results


def is_shipped(b: Bench, transpose: bool, cfg: tuple, per_sm: int, prefetch: bool, stages: int) -> bool:
    """Whether a candidate is the configuration the kernels ship with (the stages count only where the
    software pipeline is used, not the prefetch)."""
    block_1d, tile_2d, grid_cap, shipped_prefetch, shipped_stages = b.shipped
    return (
        (cfg == (tile_2d if transpose else block_1d))
        and per_sm * b.sms == grid_cap
        and prefetch == shipped_prefetch
        and (prefetch or stages == shipped_stages)
    )


def print_result(res: dict, copy_gbs: float) -> None:
    """One candidate's line, as it is measured."""
    cfg = str(tuple(res["config"]))
    print(
        f"{res['kernel']:<10} {res['shape']:<12} {cfg:<16} x{res['programs_per_sm']:<3} "
        f"{res['loads']:<11} {res['ms']:8.4f} ms "
        f"{res['GB/s']:8.0f} GB/s {res['of_copy']:6.1%} of copy ({copy_gbs:.0f})  exact={res['exact']}"
        + ("  <- shipped" if res["shipped"] else "")
        + (f"  {res['error']}" if res["error"] else ""),
        flush=True,
    )


def print_best(results: list[dict]) -> None:
    """The fastest exact candidate per kernel and shape."""
    best: dict[tuple[str, str], dict] = {}
    for r in results:
        if r["exact"] and not math.isnan(r["ms"]):
            k = (r["kernel"], r["shape"])
            if k not in best or r["ms"] < best[k]["ms"]:
                best[k] = r
    print("best per kernel and shape:")
    for (kernel, shape), r in best.items():
        print(
            f"  {kernel:<10} {shape:<12} {r['config']} x{r['programs_per_sm']} {r['loads']}: "
            f"{r['of_copy']:.1%} of copy"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernel_configs.json"))
    a = p.parse_args(argv)
    b = setup(a)
    results = []
    for transpose, shapes, configs in ((False, SHAPES_1D, CONFIGS_1D), (True, SHAPES_2D, CONFIGS_2D)):
        for m, n in SMOKE_SHAPES if a.smoke else shapes:
            results += bench_shape(b, m, n, transpose, configs)
    print_best(results)
    write_json(a.out, {"device": str(b.device), "results": results}, indent=1, announce=False)
    return 0 if all(r["exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
