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
import json
import math
import os
import statistics
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernel_configs.json"))
    a = p.parse_args(argv)
    from fp8_kernels import quantize_with_stats_reference
    from fp8_kernels.triton import launch as triton_launch
    from fp8_kernels.triton import quantize as triton_quantize

    device = torch.device("cpu" if a.smoke else "cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    fp8 = torch.float8_e4m3fn
    scale = torch.tensor(3.7, device=device)
    shipped = (
        triton_launch.block_1d(device),
        triton_launch.tile_2d(device),
        triton_launch.grid_cap(device),
        triton_launch.prefetch(device),
        triton_launch.pipeline_stages(device),
    )
    results = []

    def timed(fn, n_bufs) -> float:
        if a.smoke:
            fn(0)
            return float("nan")
        for i in range(3):
            fn(i)
        return statistics.median(ms_per_call(fn, 4 * n_bufs, device) for _ in range(a.reps))

    for transpose, shapes, configs in ((False, SHAPES_1D, CONFIGS_1D), (True, SHAPES_2D, CONFIGS_2D)):
        for m, n in SMOKE_SHAPES if a.smoke else shapes:
            n_bufs = 2 if a.smoke else max(2, math.ceil(4 * l2 / (2 * m * n)))
            g = torch.Generator(device=device).manual_seed(m + n)
            xs = [
                (torch.randn(m, n, generator=g, device=device) * 40).to(torch.bfloat16) for _ in range(n_bufs)
            ]
            q_ref, row_ref = quantize_with_stats_reference(xs[0], scale, fp8, None)
            outs = [torch.empty_like(x) for x in xs]
            copy_ms = timed(lambda i, o=outs, x=xs, k=n_bufs: o[i % k].copy_(x[i % k]), n_bufs)
            copy_gbs = 4 * m * n / (copy_ms * 1e-3) / 1e9
            useful = (4 if transpose else 3) * m * n
            for cfg, per_sm, (loads, pre, stages) in itertools.product(
                configs if not a.smoke else configs[:1], PROGRAMS_PER_SM if not a.smoke else [4], LOADS
            ):
                if transpose:
                    triton_quantize.tile_2d = lambda dev, c=cfg: c if dev.type == "cuda" else (16, 16, 4)
                else:
                    triton_quantize.block_1d = lambda dev, c=cfg: c if dev.type == "cuda" else (64, 4)
                triton_launch.grid_cap = lambda dev, k=per_sm: k * sms if dev.type == "cuda" else 3
                triton_quantize.prefetch = lambda dev, f=pre: f
                triton_quantize.pipeline_stages = lambda dev, k=stages: k
                try:
                    q, qt, row, _ = triton_quantize.launch_quantize(
                        xs[0], scale, fp8, None, transpose=transpose
                    )
                    # the FP8 bits on a GPU only: the interpreter's own cast is not the hardware's; the
                    # statistics exactly, but for the two float32 sums of squares (within their bound)
                    try:
                        same_row(row, row_ref, "statistics row")
                        exact = True
                    except AssertionError:
                        exact = False
                    if device.type == "cuda":
                        exact = exact and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                        if transpose:
                            exact = exact and torch.equal(
                                qt.view(torch.uint8), q_ref.t().contiguous().view(torch.uint8)
                            )
                    ms = timed(
                        lambda i, x=xs, k=n_bufs, t=transpose: triton_quantize.launch_quantize(
                            x[i % k], scale, fp8, None, transpose=t
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
                    "shipped": (cfg == (shipped[1] if transpose else shipped[0]))
                    and per_sm * sms == shipped[2]
                    and pre == shipped[3]
                    and (pre or stages == shipped[4]),
                    "error": err,
                }
                results.append(res)
                print(
                    f"{res['kernel']:<10} {res['shape']:<12} {str(cfg):<16} x{per_sm:<3} "
                    f"{loads:<11} {ms:8.4f} ms "
                    f"{gbs:8.0f} GB/s {res['of_copy']:6.1%} of copy ({copy_gbs:.0f})  exact={exact}"
                    + ("  <- shipped" if res["shipped"] else "")
                    + (f"  {err}" if err else ""),
                    flush=True,
                )
    best = {}
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
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"device": str(device), "results": results}, indent=1))
    return 0 if all(r["exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
