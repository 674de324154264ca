"""Host time of the quantize launchers per call, with the kernels recorded instead of run: what the Python
side of one FP8 quantize costs the training step's host thread, measured without a GPU.

A training step's host thread launches every kernel; where it is slower than the GPU, the GPU waits. Each
FP8 Linear quantizes three tensors per forward and backward, so a GPT of 48 Linears makes about 150
launcher calls a step. This runs each launcher on CPU tensors with the CUDA block sizes and its Triton
kernel replaced by a recorder (``fp8_kernels.triton.cross_build.recorded``): the time is the launcher's own
work (checks, output allocations, launch arguments) plus a recorded call, with no kernel and no device.

Two forms of the same launchers, interleaved in rounds (the median over rounds per row):

* ``planned``: as shipped: the constexprs and launch options of a call shape built once
  (``triton.quantize._plan``);
* ``rebuilt``: the plans dropped before every call, so each call builds its own, as the launcher did
  before plans were kept;
* ``prepared``: the call as the FP8 Linear makes it, through the prepared form of the same launch
  (``fp8_kernels.prepare_quantize``: checks, constexprs and grid settled once per call shape);

and ``floor``: the output allocations alone (``torch.empty`` of the FP8 outputs), which no launcher avoids.

On a GPU the launch itself differs (``triton.launch.launch``'s cached handle, and CUDA's caching allocator
instead of the CPU's); ``bench/profile_gpu.py`` measures whole layers there.

    .venv/bin/python bench/launch_host.py [--calls 3000] [--rounds 7] [--shape 512x1024] [--out PATH]
    .venv/bin/python bench/launch_host.py --smoke     # a few calls: exercises the script only

Writes bench/results/launch_host.json.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Column, table, write_report  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _calls(x: torch.Tensor) -> list[tuple[str, str, object, object]]:
    """``(row, kernel attribute of triton_quantize, call, prepare)``: each launcher as a training step calls
    it, and ``prepare()`` -> its prepared call (made once the kernels are recorded: it binds them)."""
    from fp8_kernels.reference.quantize import new_stats
    from fp8_kernels.triton import current as triton_current
    from fp8_kernels.triton import quantize as triton_quantize

    scale = torch.ones((), dtype=torch.float32)
    row = new_stats(device=x.device)
    lq = triton_quantize.launch_quantize
    c1, c2 = triton_current.quantize_current_triton, triton_current.quantize_current_transposed_triton

    def prepared(fn):
        def make():
            p = fn.prepare(x, E4M3, row, scale)
            return lambda: p(x, scale, row)

        return make

    tq = triton_quantize
    return [
        (
            "delayed, 1-D",
            "_quantize_kernel",
            lambda: lq(x, scale, E4M3, row),
            prepared(tq.quantize_with_stats_triton),
        ),
        (
            "delayed, transposed",
            "_quantize_t_kernel",
            lambda: lq(x, scale, E4M3, row, transpose=True),
            prepared(tq.quantize_with_stats_transposed_triton),
        ),
        (
            "current, 1-D (amax + quantize)",
            "_quantize_kernel",
            lambda: c1(x, E4M3, row, return_scale_inv=True),
            prepared(c1),
        ),
        (
            "current, transposed (amax + quantize)",
            "_quantize_t_kernel",
            lambda: c2(x, E4M3, row, return_scale_inv=True),
            prepared(c2),
        ),
    ]


def _per_call(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def measure(shape: tuple[int, int], calls: int, rounds: int) -> list[dict]:
    from fp8_kernels.triton import cross_build
    from fp8_kernels.triton import current as triton_current
    from fp8_kernels.triton import quantize as triton_quantize

    x = torch.randn(shape, dtype=torch.bfloat16)
    out = []
    for name, attr, call, prepare in _calls(x):
        transposed = attr == "_quantize_t_kernel"

        def floor(transposed=transposed) -> None:
            torch.empty(shape, dtype=E4M3)
            if transposed:
                torch.empty(shape[::-1], dtype=E4M3)

        def rebuilt(call=call) -> None:
            triton_quantize._PLANS.clear()
            call()

        forms = {"planned": call, "rebuilt": rebuilt, "floor": floor}
        times: dict[str, list[float]] = {k: [] for k in (*forms, "prepared")}
        with (
            cross_build.recorded(triton_quantize, attr, saturating_cast=True) as rec,
            cross_build.recorded(triton_current, "_amax_kernel") as amax_rec,
        ):
            forms["prepared"] = prepare()
            # keep only the latest launch: a recorded launch holds its outputs, and thousands of them held
            # would time the growth of the process's memory instead of the launcher
            rec.launches = collections.deque(maxlen=1)
            amax_rec.launches = collections.deque(maxlen=1)
            for fn in forms.values():
                fn()  # warm: first plans, allocator
            for r in range(rounds):
                order = list(forms) if r % 2 == 0 else list(reversed(forms))
                for form in order:
                    times[form].append(_per_call(forms[form], calls))
        median = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        out.append(
            {
                "launcher": name,
                "us_per_call": median,
                "launcher_us": {k: median[k] - median["floor"] for k in ("planned", "rebuilt", "prepared")},
                "saved_us": median["rebuilt"] - median["planned"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000, help="calls per timed block")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shape", default="512x1024", help="MxN of the bf16 input")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "launch_host.json")
    ap.add_argument("--smoke", action="store_true", help="a few calls (exercises the script only)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.calls, args.rounds = 20, 2
    shape = tuple(int(v) for v in args.shape.lower().split("x"))
    if len(shape) != 2:
        ap.error("--shape: MxN, e.g. 512x1024")
    rows = measure(shape, args.calls, args.rounds)

    def us(launcher: str, width: int) -> Column:
        return Column(launcher, lambda r: r["us_per_call"][launcher], width, ".1f")

    columns = [
        Column("launcher", "launcher", 40),
        *(us(name, 9) for name in ("planned", "rebuilt", "prepared")),
        us("floor", 7),
        Column("saved", "saved_us", 7, ".1f"),
    ]
    lines = table(rows, columns, "(us per call, host)")
    heading = f"bf16 {shape[0]}x{shape[1]}, kernels recorded (no device), median of {args.rounds} rounds"
    meta = {"smoke": args.smoke, "shape": list(shape), "calls": args.calls, "rounds": args.rounds}
    return write_report(args.out, heading, lines, rows, meta)


if __name__ == "__main__":
    sys.exit(main())
