"""Forward+backward throughput of fp8_trainer.Linear (with statistics) vs nn.Linear vs torchao's Float8Linear.

Shapes are ``MxKxN`` = tokens x in_features x out_features: ``x`` is ``(M, K)``, the weight ``(N, K)``, the
output ``(M, N)``. On an sm_89+ GPU every layer is bfloat16 and both FP8 layers use real FP8 GEMMs (fp8scope
also its Triton quantize kernels), on the default CUDA shapes 4096 x 4096 x 4096 and an LLM MLP projection
(8192 tokens, 4096 -> 14336); torchao's Float8Linear (tensorwise recipe) is compiled with torch.compile
where that works, as torchao intends it to run. On the CPU everything is float32, fp8scope runs its emulated
GEMMs and torchao its emulate mode, uncompiled. fp8scope runs delayed scaling (its default) and current
scaling; each call is one training step of that layer (statistics recorded, scales updated).

Goals (CUDA, 8192x4096x14336): fp8scope delayed >= 1.3x faster than bf16 nn.Linear, and at least on par
with compiled torchao.

How it times: one sample is N back-to-back calls (forward, then backward with a fresh gradient each time)
between one pair of CUDA events, divided by N; no host synchronisation inside a sample, so this is
throughput as in a training loop, not the latency of one synchronised call. N makes a sample last about
20 ms. Inputs and output gradients rotate over several buffers (together at least 4x the L2 cache).
Samples are interleaved across implementations (A, B, C, A, B, C, ...) so that drift of the machine hits all
alike; the table shows medians and the ratios measured in this run. The JSON goes to
bench/results/linear.json.

    python bench/linear.py [--device cpu|cuda] [--reps 10] [--shapes 1024x1024x1024,...]
    python bench/linear.py --device cuda   # GPU shapes, bfloat16
    python bench/linear.py --smoke         # one tiny shape on the CPU: exercises the script only
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import statistics
from pathlib import Path

import torch
from gpu_common import failure, print_goals, write_json
from gpu_timing import calls_per_sample, goal, ms_per_call
from torch import nn

import fp8_trainer

DEFAULT_SHAPES = "256x256x256,1024x512x512,2048x768x768,4096x1024x1024,1023x768x3072,4096x4096x1024"
CUDA_SHAPES = "4096x4096x4096,8192x4096x14336"
SMOKE_SHAPES = "64x32x48"
GOAL_SHAPE = "8192x4096x14336"
SAMPLE_MS = 20.0
RECIPES = {"fp8scope": fp8_trainer.DelayedScaling(), "fp8scope current": fp8_trainer.CurrentScaling()}


def make_torchao(ref: nn.Linear, device: torch.device) -> tuple[nn.Module | None, str]:
    """torchao's Float8Linear (tensorwise) on a copy of ``ref``: ``(module, how)``, or ``(None, why not)``."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # ImportError, or a torchao built for another torch
        return None, f"not importable ({type(e).__name__}: {e})"
    emulate = device.type != "cuda"
    try:
        if emulate:
            config = Float8LinearConfig(emulate=True)
        else:
            config = Float8LinearConfig.from_recipe_name("tensorwise")
        mod = convert_to_float8_training(nn.Sequential(copy.deepcopy(ref)), config=config)
    except Exception as e:  # a torchao that does not work with this torch
        return None, f"conversion failed ({type(e).__name__}: {e})"
    return mod, "emulate" if emulate else "tensorwise"


def build_layers(
    k: int, n: int, device: torch.device, dtype: torch.dtype, use_torchao: bool
) -> tuple[dict[str, nn.Module], str]:
    """The layers compared, all copies of one ``nn.Linear``: the reference, fp8scope's per recipe, and
    torchao's where asked for and available; and how torchao runs (or why it does not)."""
    ref = nn.Linear(k, n).to(device=device, dtype=dtype)
    layers: dict[str, nn.Module] = {"nn.Linear": ref}
    for name in RECIPES:
        layers[name] = fp8_trainer.convert_to_fp8(copy.deepcopy(ref))
    torchao_how = "not requested"
    if use_torchao:
        ao, torchao_how = make_torchao(ref, device)
        if ao is not None:
            layers["torchao"] = ao
    return layers, torchao_how


def make_runner(layer: nn.Module, recipe, xs: list[torch.Tensor], gs: list[torch.Tensor]):
    """``run(i)``: one training step of ``layer`` on the ``i``-th rotating input (forward under the recipe's
    ``fp8_autocast`` where it has one, backward with a fresh gradient); gradients are replaced, not
    accumulated, so every call does the same work."""
    params = list(layer.parameters())
    n_bufs = len(xs)

    def run(i: int) -> torch.Tensor:
        x, g = xs[i % n_bufs], gs[i % n_bufs]
        x.grad = None
        for p in params:
            p.grad = None
        if recipe is not None:
            with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
        else:
            y = layer(x)
        y.backward(g)
        return y

    return run


def settle_torchao(runs: dict, layers: dict[str, nn.Module], xs: list, gs: list, device, how: str) -> str:
    """torchao compiled on CUDA where torch.compile works there (eager otherwise, and said so), then dropped
    from ``runs`` where it does not run at all; returns how it ran, updated."""
    if "torchao" in runs and device.type == "cuda":
        compiled = make_runner(torch.compile(layers["torchao"]), None, xs, gs)
        try:
            compiled(0)
            runs["torchao"] = compiled
            how += ", compiled"
        except Exception as e:  # torch.compile unavailable here: eager torchao, and say so
            how += f", eager (torch.compile failed: {type(e).__name__})"
    if "torchao" in runs:
        try:
            runs["torchao"](0)
        except Exception as e:  # torchao that does not run here: the others are still measured
            del runs["torchao"]
            how += f"; {failure(e)}"
    return how


def relative_errors(runs: dict) -> dict[str, float]:
    """What each computes: the normwise relative error of its output against the ``nn.Linear``'s."""
    outs = {name: run(0).detach().float() for name, run in runs.items()}
    base = outs["nn.Linear"]
    return {name: float((o - base).norm() / base.norm()) for name, o in outs.items()}


def sample_times(runs: dict, device: torch.device, reps: int, n_bufs: int, smoke: bool):
    """Per implementation: the calls per sample (after a warm-up: kernels compiled, allocator warm; N for
    about SAMPLE_MS) and ``reps`` samples' ms per call, interleaved across implementations."""
    counts = {}
    for name, run in runs.items():
        if smoke:
            counts[name] = 2
            continue
        for i in range(3):
            run(i)
        counts[name] = calls_per_sample(
            run, device, SAMPLE_MS, min_calls=n_bufs, max_calls=200, floor_ms=1e-3
        )
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            times[name].append(ms_per_call(run, counts[name], device))
    return counts, times


def bench_shape(m: int, k: int, n: int, device, reps: int, smoke: bool, use_torchao: bool) -> dict:
    """One shape: every layer's forward+backward timed over rotating inputs, and its output's error."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layers, torchao_how = build_layers(k, n, device, dtype, use_torchao)

    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    per_buf = (m * k + m * n) * (2 if device.type == "cuda" else 4)
    n_bufs = 2 if smoke else max(2, min(16, math.ceil(4 * l2 / per_buf)))
    xs = [torch.randn(m, k, device=device, dtype=dtype).requires_grad_(True) for _ in range(n_bufs)]
    gs = [torch.randn(m, n, device=device, dtype=dtype) for _ in range(n_bufs)]

    runs = {name: make_runner(layer, RECIPES.get(name), xs, gs) for name, layer in layers.items()}
    torchao_how = settle_torchao(runs, layers, xs, gs, device, torchao_how)
    rel_err = relative_errors(runs)
    counts, times = sample_times(runs, device, reps, n_bufs, smoke)
    for name in RECIPES:  # statistics really were recorded
        assert fp8_trainer.step_stats(layers[name]) is not None, name
    med = {name: statistics.median(v) for name, v in times.items()}
    flops = 6 * m * k * n  # forward, dgrad, wgrad
    row = {
        "shape": f"{m}x{k}x{n}",
        "median_ms": med,
        "spread_ms": {name: [min(v), max(v)] for name, v in times.items()},
        "calls_per_sample": counts,
        "input_buffers": n_bufs,
        "tflops": {name: flops / (ms * 1e-3) / 1e12 for name, ms in med.items()},
        "rel_err_vs_nn": rel_err,
        "torchao": torchao_how,
        "speedup_vs_nn": {name: med["nn.Linear"] / ms for name, ms in med.items()},
    }
    row["fp8scope/nn"] = med["fp8scope"] / med["nn.Linear"]  # time ratios (< 1: fp8scope faster)
    if "torchao" in med:
        row["fp8scope/torchao"] = med["fp8scope"] / med["torchao"]
        row["torchao/nn"] = med["torchao"] / med["nn.Linear"]
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``--help`` shows the module's docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=10, help="timed samples per implementation and shape")
    p.add_argument("--shapes", default=None, help="comma-separated MxKxN (tokens x in x out)")
    p.add_argument("--no-torchao", action="store_true", help="leave torchao's Float8Linear out")
    p.add_argument("--smoke", action="store_true", help="one tiny shape on the CPU, 2 samples of 2 calls")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "linear.json"))
    return p.parse_args(argv)


def print_header(device: torch.device, reps: int, smoke: bool) -> None:
    """What runs where, then the table's head."""
    print(
        f"forward+backward, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", {'bfloat16' if device.type == 'cuda' else 'float32'}, {torch.get_num_threads()} threads, "
        f"median of {reps} samples of back-to-back calls" + (" (smoke: not a measurement)" if smoke else "")
    )
    print(
        f"{'shape (MxKxN)':<18} {'nn.Linear ms':>12} {'fp8scope ms':>11} {'current ms':>10} "
        f"{'torchao ms':>10} {'x nn':>6} {'cur x nn':>8} {'ao x nn':>7} {'x torchao':>9} {'fp8 TFLOP/s':>11}"
    )


def print_row(row: dict) -> None:
    """One shape's line, printed as soon as it is measured."""
    med, sp = row["median_ms"], row["speedup_vs_nn"]
    ao = f"{med['torchao']:10.3f}" if "torchao" in med else f"{'n/a':>10}"
    ao_x = f"{sp['torchao']:7.2f}" if "torchao" in sp else f"{'n/a':>7}"
    vs_ao = f"{1 / row['fp8scope/torchao']:9.2f}" if "fp8scope/torchao" in row else f"{'n/a':>9}"
    print(
        f"{row['shape']:<18} {med['nn.Linear']:12.3f} {med['fp8scope']:11.3f} "
        f"{med['fp8scope current']:10.3f} {ao} {sp['fp8scope']:6.2f} {sp['fp8scope current']:8.2f} "
        f"{ao_x} {vs_ao} "
        f"{row['tflops']['fp8scope']:11.1f}",
        flush=True,
    )


def print_errors(rows: list[dict]) -> None:
    """How torchao ran per shape, and each FP8 layer's output error against nn.Linear."""
    print("torchao: " + "; ".join(f"{r['shape']} {r['torchao']}" for r in rows))
    errs = []
    for r in rows:
        fp8_errs = {k: v for k, v in r["rel_err_vs_nn"].items() if k != "nn.Linear"}
        errs.append(f"{r['shape']} " + ", ".join(f"{k} {v:.2e}" for k, v in fp8_errs.items()))
    print("output error vs nn.Linear (normwise): " + "; ".join(errs))


def linear_goals(at: dict) -> dict:
    """The goals at GOAL_SHAPE: fp8scope 1.3x nn.Linear, and on par with torchao where it ran."""
    goals = {
        "fp8scope_1.3x_bf16": goal(
            at["speedup_vs_nn"]["fp8scope"], 1.3, f"{GOAL_SHAPE}: nn.Linear time / fp8scope time"
        )
    }
    if "fp8scope/torchao" in at:
        goals["fp8scope_vs_torchao"] = goal(
            1 / at["fp8scope/torchao"], 1.0, f"{GOAL_SHAPE}: torchao time / fp8scope time"
        )
    return goals


def summarise(last: dict) -> str:
    """The one-line summary scripts/gpu-check.sh shows: the goal shape's row, or the last one."""
    summary = f"{last['shape']}: fp8scope x{last['speedup_vs_nn']['fp8scope']:.2f} vs nn.Linear"
    summary += f", current x{last['speedup_vs_nn']['fp8scope current']:.2f}"
    if "fp8scope/torchao" in last:
        return summary + f", x{1 / last['fp8scope/torchao']:.2f} vs torchao ({last['torchao']})"
    return summary + f", torchao n/a ({last['torchao']})"


def run_meta(device: torch.device, reps: int, smoke: bool) -> dict:
    """What was run, where, and how it was timed: the JSON's ``meta``."""
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "reps": reps,
        "smoke": smoke,
        "dtype": "bfloat16" if device.type == "cuda" else "float32",
        "shape_order": "MxKxN = tokens x in_features x out_features",
        "timing": "median over samples of N back-to-back forward+backward calls between one CUDA event pair, "
        "divided by N; inputs and gradients rotated over buffers totalling >= 4x L2",
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device = torch.device("cpu" if a.smoke else a.device)
    reps = 2 if a.smoke else a.reps
    default = SMOKE_SHAPES if a.smoke else CUDA_SHAPES if device.type == "cuda" else DEFAULT_SHAPES
    print_header(device, reps, a.smoke)
    rows = []
    for spec in (a.shapes or default).split(","):
        m, k, n = (int(v) for v in spec.lower().split("x"))
        rows.append(bench_shape(m, k, n, device, reps, a.smoke, not a.no_torchao))
        print_row(rows[-1])
    print_errors(rows)
    goals = {}
    at = next((r for r in rows if r["shape"] == GOAL_SHAPE), None)
    if device.type == "cuda" and at is not None:
        goals = linear_goals(at)
        print(f"goals at {GOAL_SHAPE}:")
        print_goals(goals, 22, "6.2f")
    else:
        print(f"goals: measured on CUDA at {GOAL_SHAPE} only; not assessed in this run")
    summary = summarise(at or rows[-1])
    write_json(
        a.out, {"meta": run_meta(device, reps, a.smoke), "goals": goals, "summary": summary, "rows": rows}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
