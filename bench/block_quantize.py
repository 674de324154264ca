"""Block-scaled quantization: the Triton kernel (``triton.block_quantize``) vs the PyTorch reference (CUDA).

For bfloat16 tensors of 4096 x N elements and each block recipe (MXFP8 1x32 E8M0, FP8 block scaling 1x128
and 128x128 float32 scales), per call:

* ``triton``: the kernel with the statistics merged into a statistics row and block row (the quantize
  launch and the one-program fold): what the block-scaled Linear runs per recorded tensor on a GPU;
* ``triton-q``: the kernel alone, no statistics (the quantization's own cost);
* ``eager``: ``quantize_blocks`` then ``block_tensor_stats``, the reference path (what ran on every device
  before the kernel).

Bandwidth is useful bytes / time (the bf16 input read once, the FP8 output written once). The FP8 bits and
``scale_inv`` of the kernel are checked against the reference's in the same run (``bits equal``). Timing as
``kernels.py`` (``gpu_timing``): N back-to-back calls between CUDA events, medians over interleaved samples,
inputs rotating over at least 4x the L2 cache. JSON to bench/results/block_quantize.json.

    python bench/block_quantize.py [--cols 4096 16384] [--reps 15]
    TRITON_INTERPRET=1 python bench/block_quantize.py --smoke   # tiny sizes on the CPU: the script only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from gpu_timing import ms_per_call, sync

from fp8_kernels.reference.block_quantize import quantize_blocks
from fp8_trainer.block_linear import BlockSpec, block_tensor_stats, new_block_stats

RECIPES = {
    "mxfp8 1x32": ((1, 32), "e8m0"),
    "block 1x128": ((1, 128), "fp32"),
    "block 128x128": ((128, 128), "fp32"),
}
FP8 = torch.float8_e4m3fn


def impls(block, fmt):
    from fp8_kernels.triton.block_quantize import block_quantize_triton

    spec = BlockSpec(fmt, block[1], two_d=block[0] > 1)

    held = {}  # the rows, made once (a Linear's live in the step's statistics buffers)

    def triton(x):
        if x.device not in held:
            held[x.device] = (
                torch.zeros(10, dtype=torch.float64, device=x.device),
                new_block_stats(1, x.device)[0],
            )
        stats, block_row = held[x.device]
        return block_quantize_triton(x, FP8, block, fmt, stats=stats, block_stats=block_row), None

    def triton_q(x):
        return block_quantize_triton(x, FP8, block, fmt), None

    def eager(x):
        q = quantize_blocks(x, FP8, block, fmt)
        return q, block_tensor_stats(x, q, FP8, spec)

    return {"triton": triton, "triton-q": triton_q, "eager": eager}


def bench(rows: int, cols: int, name: str, device, reps: int, smoke: bool) -> dict:
    block, fmt = RECIPES[name]
    fns = impls(block, fmt)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 1
    n_inputs = max(2, -(-4 * l2 // (rows * cols * 2)))
    g = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(rows, cols, generator=g, device=device).to(torch.bfloat16) for _ in range(n_inputs)]
    (q, _), (ref, _) = fns["triton"](xs[0]), fns["eager"](xs[0])
    equal = torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(
        q.scale_inv.contiguous().view(torch.uint8), ref.scale_inv.view(torch.uint8)
    )
    calls = 2 if smoke else 20
    keep = []

    def runner(fn):
        def run(i):
            keep.append(fn(xs[i % n_inputs]))
            if len(keep) > n_inputs:
                keep.pop(0)

        return run

    runs = {k: runner(fn) for k, fn in fns.items()}
    for run in runs.values():
        run(0)
    sync(device)
    samples = {k: [] for k in runs}
    for _ in range(reps):
        for k, run in runs.items():  # interleaved
            samples[k].append(ms_per_call(run, calls, device))
    ms = {k: statistics.median(v) for k, v in samples.items()}
    useful = rows * cols * 3  # bf16 read + FP8 write
    return {
        "recipe": name,
        "shape": [rows, cols],
        "ms": ms,
        "gbps": {k: useful / (v * 1e-3) / 1e9 for k, v in ms.items()},
        "speedup_vs_eager": ms["eager"] / ms["triton"],
        "bits_equal": bool(equal),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if args.smoke:
        device, rows, cols, reps = torch.device("cpu"), 64, [256], 2
    elif torch.cuda.is_available():
        device, rows, cols, reps = torch.device("cuda"), args.rows, args.cols, args.reps
    else:
        print("block_quantize: needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    results = [bench(rows, c, name, device, reps, args.smoke) for c in cols for name in RECIPES]
    print(
        f"{'recipe':<14} {'shape':>12} {'triton ms':>10} {'triton-q ms':>12} {'eager ms':>9} "
        f"{'triton GB/s':>12} {'x eager':>8} {'bits equal':>10}"
    )
    for r in results:
        print(
            f"{r['recipe']:<14} {'x'.join(map(str, r['shape'])):>12} {r['ms']['triton']:>10.4f} "
            f"{r['ms']['triton-q']:>12.4f} {r['ms']['eager']:>9.4f} {r['gbps']['triton']:>12.1f} "
            f"{r['speedup_vs_eager']:>8.2f} {str(r['bits_equal']):>10}"
        )
    if not args.smoke:
        out = Path(__file__).parent / "results" / "block_quantize.json"
        out.parent.mkdir(exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
        out.write_text(json.dumps({"meta": meta, "rows": results}, indent=2))
    return 0 if all(r["bits_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
