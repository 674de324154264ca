"""Forward+backward time of fp8_trainer.Linear (with statistics) vs nn.Linear vs torchao's Float8Linear.

On the CPU torchao runs in its emulate mode and fp8scope in its emulated GEMM, in float32; on an sm_89+ GPU
both use real FP8 GEMMs (and fp8scope its Triton quantize kernels) on bfloat16 layers, for large shapes by
default: 4096 x 4096 x 4096 and an LLM MLP projection (8192 tokens, 4096 -> 14336). Goals there: fp8scope
>= 1.3x faster than bf16 nn.Linear and at least on par with torchao. Repetitions are interleaved
(A, B, C, A, B, C, ...) so that load changes on the machine hit all three alike; the table shows medians and
the ratios measured in this run, and the JSON goes to bench/results/linear.json.

    python bench/linear.py [--device cpu|cuda] [--reps 15] [--shapes 1024x1024x1024,...]
    python bench/linear.py --device cuda   # GPU shapes, bfloat16
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import fp8_trainer

DEFAULT_SHAPES = "256x256x256,1024x512x512,2048x768x768,4096x1024x1024,1023x768x3072,4096x4096x1024"
CUDA_SHAPES = "4096x4096x4096,8192x4096x14336"


def make_torchao(ref: nn.Linear, emulate: bool):
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return None
    return Float8Linear.from_float(copy.deepcopy(ref), config=Float8LinearConfig(emulate=emulate))


def timer(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def bench_shape(m: int, k: int, n: int, device: torch.device, reps: int, warmup: int = 2) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref = nn.Linear(k, n).to(device=device, dtype=dtype)
    fp8 = fp8_trainer.convert_to_fp8(copy.deepcopy(ref))
    ao = make_torchao(ref, emulate=device.type != "cuda")
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=dtype)

    def run_nn():
        ref(x).backward(g)

    def run_fp8():
        with fp8_trainer.fp8_autocast():
            y = fp8(x)
        y.backward(g)

    def run_ao():
        ao(x).backward(g)

    runs = {"nn.Linear": run_nn, "fp8scope": run_fp8}
    if ao is not None:
        runs["torchao"] = run_ao
    times = {name: [] for name in runs}
    for i in range(warmup + reps):
        for name, fn in runs.items():
            t0 = timer(device)
            fn()
            t1 = timer(device)
            if i >= warmup:
                times[name].append((t1 - t0) * 1e3)
    assert fp8_trainer.step_stats(fp8) is not None  # statistics really were recorded
    med = {name: statistics.median(v) for name, v in times.items()}
    row = {"shape": f"{m}x{k}x{n}", "median_ms": med}
    row["fp8scope/nn"] = med["fp8scope"] / med["nn.Linear"]
    if "torchao" in med:
        row["fp8scope/torchao"] = med["fp8scope"] / med["torchao"]
        row["torchao/nn"] = med["torchao"] / med["nn.Linear"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--shapes", default=None, help="comma-separated MxKxN (tokens x in x out)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "linear.json"))
    a = p.parse_args(argv)
    device = torch.device(a.device)
    shapes = a.shapes or (CUDA_SHAPES if device.type == "cuda" else DEFAULT_SHAPES)
    rows = []
    header = (
        f"{'shape (MxKxN)':<18} {'nn.Linear ms':>12} {'torchao ms':>11} {'fp8scope ms':>12} "
        f"{'fp8scope/torchao':>17} {'fp8scope/nn':>12}"
    )
    print(f"forward+backward, device {device}, {torch.get_num_threads()} threads, median of {a.reps}")
    print(header)
    for spec in shapes.split(","):
        m, k, n = (int(v) for v in spec.lower().split("x"))
        row = bench_shape(m, k, n, device, a.reps)
        rows.append(row)
        med = row["median_ms"]
        ao = f"{med['torchao']:11.2f}" if "torchao" in med else f"{'n/a':>11}"
        ratio = f"{row['fp8scope/torchao']:17.2f}" if "fp8scope/torchao" in row else f"{'n/a':>17}"
        print(
            f"{row['shape']:<18} {med['nn.Linear']:12.2f} {ao} {med['fp8scope']:12.2f} {ratio} "
            f"{row['fp8scope/nn']:12.2f}",
            flush=True,
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "reps": a.reps,
        "dtype": "bfloat16" if device.type == "cuda" else "float32",
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
