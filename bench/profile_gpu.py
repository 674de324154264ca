"""Where the time of an FP8 Linear and of a GPT training step goes: torch.profiler tables for a lent GPU.

Not a benchmark with goals (bench/linear.py and bench/gpt_throughput.py are): a diagnostic that says which
kernels and which host-side operations a step spends its time in, so that an optimisation starts from a
measurement. Its parts, each printed as a table:

* host time per call: forward+backward of one small layer (512 x 512 x 512), N calls back to back and one
  synchronisation, so the GPU work is negligible and the wall time per call is the host's (Python, dispatch,
  launches); fp8scope delayed / current against nn.Linear;
* the kernels of one FP8 Linear forward+backward at the goal shape (8192 x 4096 x 14336), delayed scaling,
  by total device time;
* the kernels and the host operations of one GPT-124M training step (delayed scaling, statistics read one
  step late), by total device time and by host self time; ``gpt-compiled``: the same step with the model
  under ``torch.compile`` (what lies between the FP8 Linears fused).

    python bench/profile_gpu.py [--out profile.txt]
    python bench/profile_gpu.py --smoke     # tiny sizes on the CPU: exercises the script only
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import pstats
import sys
import time

import torch
from gpu_timing import sync
from torch import nn
from torch.profiler import ProfilerActivity, profile

import fp8_trainer
from fp8_trainer.app.model import GPT, fp8_filter, preset_config

RECIPES = {"delayed": fp8_trainer.DelayedScaling, "current": fp8_trainer.CurrentScaling}


def linear_step(layer: nn.Module, recipe, x: torch.Tensor, g: torch.Tensor) -> None:
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    if recipe is None:
        y = layer(x)
    else:
        with fp8_trainer.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
    y.backward(g)


def make_layers(m: int, k: int, n: int, device, dtype):
    torch.manual_seed(0)
    ref = nn.Linear(k, n).to(device=device, dtype=dtype)
    layers = {"nn.Linear": (ref, None)}
    for name, cls in RECIPES.items():
        layers[f"fp8scope {name}"] = (fp8_trainer.convert_to_fp8(copy.deepcopy(ref)), cls())
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=dtype)
    return layers, x, g


def host_time(device, dtype, calls: int, out) -> None:
    layers, x, g = make_layers(512, 512, 512, device, dtype)
    print("\n== host time per forward+backward, 512x512x512 (wall time of back-to-back calls) ==", file=out)
    for name, (layer, recipe) in layers.items():
        for _ in range(5):
            linear_step(layer, recipe, x, g)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            linear_step(layer, recipe, x, g)
        sync(device)
        print(f"{name:<20} {(time.perf_counter() - t0) * 1e3 / calls:8.3f} ms per call", file=out)
    layer, recipe = layers["fp8scope delayed"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            linear_step(layer, recipe, x, g)
        sync(device)
    print("\n-- fp8scope delayed, 10 calls: host operations by self time --", file=out)
    print(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70),
        file=out,
    )


def host_python(device, dtype, calls: int, out) -> None:
    """cProfile of back-to-back small-layer calls and of bare quantize launches: which Python functions the
    host time per FP8 Linear goes to."""
    layers, x, g = make_layers(512, 512, 512, device, dtype)
    from fp8_kernels import quantize_with_stats, quantize_with_stats_transposed

    scale = torch.ones((), device=device)
    for name in ("fp8scope delayed", "fp8scope current"):
        layer, recipe = layers[name]
        for _ in range(5):
            linear_step(layer, recipe, x, g)
        sync(device)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            linear_step(layer, recipe, x, g)
        sync(device)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(35)
        print(f"\n== cProfile, {name} 512^3 forward+backward x {calls}: by own time ==", file=out)
        print(buf.getvalue(), file=out)
    x2 = x.detach()
    for label, fn in (
        ("quantize_with_stats", lambda: quantize_with_stats(x2, scale, torch.float8_e4m3fn)),
        (
            "quantize_with_stats_transposed",
            lambda: quantize_with_stats_transposed(x2, scale, torch.float8_e4m3fn),
        ),
        ("torch.empty_like", lambda: torch.empty_like(x2)),
        ("x.abs()", lambda: x2.abs()),
    ):
        for _ in range(10):
            fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls * 5):
            fn()
        t1 = time.perf_counter()
        sync(device)
        print(f"host time per call {label:<32} {(t1 - t0) / (calls * 5) * 1e6:8.1f} us", file=out)


def activities(device):
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def sort_key(device) -> str:
    return "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"


def linear_kernels(device, dtype, shape, out) -> None:
    m, k, n = shape
    layers, x, g = make_layers(m, k, n, device, dtype)
    for name in ("nn.Linear", "fp8scope delayed", "fp8scope current"):
        layer, recipe = layers[name]
        for _ in range(3):
            linear_step(layer, recipe, x, g)
        sync(device)
        with profile(activities=activities(device)) as prof:
            for _ in range(5):
                linear_step(layer, recipe, x, g)
            sync(device)
        print(f"\n== {name}, {m}x{k}x{n}, 5 calls: operations by device self time ==", file=out)
        print(
            prof.key_averages().table(sort_by=sort_key(device), row_limit=25, max_name_column_width=90),
            file=out,
        )


def gpt_step(device, preset: str, batch: int, seq: int, out, compiled: bool = False) -> None:
    torch.manual_seed(0)
    model = GPT(preset_config(preset, 50304)).to(device)
    recipe = fp8_trainer.DelayedScaling()
    fp8_trainer.convert_to_fp8(model, recipe=recipe, module_filter_fn=fp8_filter)
    reader = fp8_trainer.StatsReader(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    x = torch.randint(0, 50304, (batch, seq), device=device)
    y = torch.randint(0, 50304, (batch, seq), device=device)
    forward = torch.compile(model) if compiled else model  # compiled: the warm-up steps compile

    def step():
        with fp8_trainer.fp8_autocast(fp8_recipe=recipe), torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        reader.poll()

    for _ in range(3):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    sync(device)
    print(
        f"\n== GPT {preset}, batch {batch}x{seq}, delayed{', compiled' if compiled else ''}: "
        f"{(time.perf_counter() - t0) / 3 * 1e3:.1f} ms per step ==",
        file=out,
    )
    with profile(activities=activities(device)) as prof:
        for _ in range(2):
            step()
        sync(device)
    avg = prof.key_averages()
    print("-- 2 steps: operations by device self time --", file=out)
    print(avg.table(sort_by=sort_key(device), row_limit=40, max_name_column_width=90), file=out)
    print("-- 2 steps: host operations by self time --", file=out)
    print(avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90), file=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None, help="also write the tables to this file")
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated parts: python,host,linear,gpt,gpt-compiled (default: all)",
    )
    a = p.parse_args(argv)
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    class Tee:
        def __init__(self, *files):
            self.files = files

        def write(self, s):
            for f in self.files:
                f.write(s)

        def flush(self):
            for f in self.files:
                f.flush()

    with open(a.out, "w") if a.out else contextlib.nullcontext() as fh:
        return run_parts(a, device, dtype, Tee(sys.stdout, *([fh] if fh else [])))


def run_parts(a: argparse.Namespace, device: torch.device, dtype: torch.dtype, out) -> int:
    """Each part asked for, its tables to ``out``; 1 where one failed (the others still ran)."""
    gpt_shape = ("tiny", 2, 32) if a.smoke else ("124m", 16, 1024)  # preset, batch, sequence length
    parts = [
        ("python", lambda: host_python(device, dtype, 5 if a.smoke else 200, out)),
        ("host", lambda: host_time(device, dtype, 5 if a.smoke else 200, out)),
        (
            "linear",
            lambda: linear_kernels(device, dtype, (64, 32, 48) if a.smoke else (8192, 4096, 14336), out),
        ),
        ("gpt", lambda: gpt_step(device, *gpt_shape, out)),
        ("gpt-compiled", lambda: gpt_step(device, *gpt_shape, out, compiled=True)),
    ]
    if a.only:
        parts = [(name, part) for name, part in parts if name in a.only.split(",")]
    failed = 0
    for name, part in parts:
        try:
            part()
        except Exception as e:  # one part failing still leaves the others' tables
            failed += 1
            print(f"\n== {name}: failed: {type(e).__name__}: {e}", file=out)
        out.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
