"""Bandwidth of the fused quantize + statistics kernel against PyTorch eager and torch.compile (CUDA).

For 2^20 ... 2^28 bfloat16 elements, each implementation quantizes to FP8 (delayed scaling) and accumulates
the statistics row; its effective bandwidth is (bytes read + bytes written) / time, shown as a fraction of
the device's copy bandwidth measured in the same run (``dst.copy_(src)`` of the largest size). Goals: the
Triton kernel at >= 80% of copy bandwidth and >= 2x the eager reference. ``triton+T`` is the same kernel
also writing the transposed FP8 tensor (of the input viewed as rows of 1024), the layout backward GEMMs
take. Times are medians of CUDA-event timed repetitions, interleaved across implementations. The JSON goes
to bench/results/kernels.json.

    python bench/kernels.py [--min-exp 20] [--max-exp 28] [--reps 20] [--format e4m3|e5m2]
    TRITON_INTERPRET=1 python bench/kernels.py --smoke   # tiny sizes on the CPU: exercises the script only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class Timer:
    """Milliseconds of one call: CUDA events on a GPU, the wall clock on the CPU (smoke runs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def copy_bandwidth(nbytes: int, device: torch.device, reps: int, timer: Timer) -> float:
    """GB/s of ``dst.copy_(src)`` (read + write) for ``nbytes``-byte buffers."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [timer(lambda: dst.copy_(src)) for _ in range(reps)]
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def bench_size(n: int, impls: dict, fp8: torch.dtype, device: torch.device, reps: int, timer: Timer) -> dict:
    g = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    scale = torch.tensor(3.7, device=device)
    stats = {name: torch.zeros(6, dtype=torch.float64, device=device) for name in impls}
    for name, fn in impls.items():  # warm-up: compilation, autotuning caches
        fn(x, scale, fp8, stats[name])
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(reps):
        for name, fn in impls.items():
            times[name].append(timer(lambda fn=fn, name=name: fn(x, scale, fp8, stats[name])))
    ref = stats["eager"]
    matches = {}
    for name, row in stats.items():  # every implementation must count the same (reps + 1 calls each)
        matches[name] = torch.equal(row.nan_to_num(-1), ref.nan_to_num(-1))
        if not matches[name]:
            print(f"WARNING: {name}: statistics {row.tolist()} differ from eager {ref.tolist()}")
    moved = n * (x.element_size() + 1)  # read bf16, write FP8
    row = {"numel": n, "bytes_moved": moved, "stats_match_eager": matches}
    for name, t in times.items():
        ms = statistics.median(t)
        nbytes = moved + n if name == "triton+T" else moved  # the transpose: one more FP8 write
        row[name] = {"ms": ms, "gbps": nbytes / (ms * 1e-3) / 1e9}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-exp", type=int, default=20)
    p.add_argument("--max-exp", type=int, default=28)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--format", choices=sorted(FORMATS), default="e4m3")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernels.json"))
    a = p.parse_args(argv)

    if a.smoke:
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
        elif os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke: triton is already imported without TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        device, sizes, reps, backend = torch.device("cpu"), [2**10, 2**12], 2, "eager"
    else:
        if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
            print("bench/kernels.py: needs a CUDA GPU with FP8 support (sm_89+); none here, nothing measured")
            return 0
        device, reps, backend = torch.device("cuda"), a.reps, "inductor"
        sizes = [2**e for e in range(a.min_exp, a.max_exp + 1)]

    import triton
    from fp8_kernels import quantize_with_stats_reference
    from fp8_kernels.triton_quantize import quantize_with_stats_transposed_triton, quantize_with_stats_triton

    def with_transpose(x, scale, fp8, stats):
        return quantize_with_stats_transposed_triton(x.view(-1, 1024), scale, fp8, stats)

    dynamo = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):  # one compilation per size
        if hasattr(dynamo, knob):
            setattr(dynamo, knob, max(64, getattr(dynamo, knob)))
    impls = {
        "triton": quantize_with_stats_triton,
        "eager": quantize_with_stats_reference,
        "compile": torch.compile(quantize_with_stats_reference, backend=backend),
        "triton+T": with_transpose,
    }
    fp8 = FORMATS[a.format]
    timer = Timer(device)
    copy_gbps = copy_bandwidth(2 * max(sizes), device, max(reps, 5), timer)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"fused quantize+stats, bf16 -> {a.format}, {name}, copy bandwidth {copy_gbps:.0f} GB/s, "
          f"median of {reps}{' (smoke: interpreter, not a measurement)' if a.smoke else ''}")
    print(f"{'numel':>10} {'triton GB/s':>12} {'%copy':>6} {'eager GB/s':>11} {'%copy':>6} "
          f"{'compile GB/s':>13} {'%copy':>6} {'x eager':>8} {'x compile':>10} "
          f"{'triton+T GB/s':>14} {'%copy':>6}")
    rows = []
    for n in sizes:
        row = bench_size(n, impls, fp8, device, reps, timer)
        for impl in impls:
            row[impl]["fraction_of_copy"] = row[impl]["gbps"] / copy_gbps
        row["speedup_vs_eager"] = row["eager"]["ms"] / row["triton"]["ms"]
        row["speedup_vs_compile"] = row["compile"]["ms"] / row["triton"]["ms"]
        rows.append(row)
        print(f"{n:>10} {row['triton']['gbps']:12.1f} {row['triton']['fraction_of_copy']:6.0%} "
              f"{row['eager']['gbps']:11.1f} {row['eager']['fraction_of_copy']:6.0%} "
              f"{row['compile']['gbps']:13.1f} {row['compile']['fraction_of_copy']:6.0%} "
              f"{row['speedup_vs_eager']:8.2f} {row['speedup_vs_compile']:10.2f} "
              f"{row['triton+T']['gbps']:14.1f} {row['triton+T']['fraction_of_copy']:6.0%}", flush=True)
    big = rows[-1]
    goals = {
        "triton_at_least_80pct_of_copy": big["triton"]["fraction_of_copy"] >= 0.8,
        "triton_at_least_2x_eager": big["speedup_vs_eager"] >= 2.0,
    }
    print(f"goals at {big['numel']} elements: " + ", ".join(f"{k}={v}" for k, v in goals.items()))
    meta = {
        "device": name,
        "device_type": device.type,
        "smoke": a.smoke,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "input_dtype": "bfloat16",
        "fp8_format": a.format,
        "copy_gbps": copy_gbps,
        "reps": reps,
        "compile_backend": backend,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "goals": goals, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
