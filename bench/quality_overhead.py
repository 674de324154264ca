"""Benchmark: what the quality statistics (sum_sq, err_sq, subnormal, min_abs) cost a training step.

The same FP8 run (tiny GPT, delayed scaling, statistics for every tensor at every step) in two modes, in one
process, interleaved in blocks so that drift of the machine hits both alike:

* ``base``    - the quantize pass records the base columns alone (``FP8State.set_quality_stats(False)``:
  6-column statistics rows, which the quantize functions take as "no quality statistics");
* ``quality`` - the default: the quality columns too, in the same pass.

Each mode trains its own copy of the model (same seed, same batches). No monitor: the difference is the
statistics' computation (on the CPU, the extra arithmetic of the fused quantize kernel, ``cpu/fused.c``).
``--reference`` adds both modes on the PyTorch references (``base-ref``, ``quality-ref``: the CPU path
before the fused kernel, or where it does not build), interleaved with the others, and prints the paired
ratios between them.

    .venv/bin/python bench/quality_overhead.py [--rounds 10] [--block 10] [--batch-size 16] [--seq-len 64]
        [--reference]

Prints median and mean step times, the ratio quality/base overall and paired by round (the median over
rounds of each round's ratio, robust to the machine's drift) and the load average; writes
bench/results/quality_overhead.json. Goal: quality/base <= 1.03 on the CPU. On a shared machine, read the
numbers beside the load average: a second process on a 2-core machine makes both modes several times
slower and the ratio noise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import TinyGPTJob, modes_parser, print_load_average, warm_up, write_json  # noqa: E402
from bench.interleaved import interleave  # noqa: E402
from fp8_kernels import has_kernel, reference_kernels  # noqa: E402
from fp8_trainer import fp8_autocast, tensor_table  # noqa: E402
from fp8_trainer.convert import get_fp8_state  # noqa: E402

MODES = ("base", "quality")
REFERENCE_MODES = ("base-ref", "quality-ref")


class Job(TinyGPTJob):
    """One mode's model (quality statistics on or off, the fused kernel or the references), optimizer and
    data stream."""

    def __init__(self, mode: str, args: argparse.Namespace):
        super().__init__(args)
        get_fp8_state(self.model).set_quality_stats(mode.startswith("quality"))
        self.reference = mode.endswith("-ref")  # the PyTorch references instead of the CPU's fused kernel

    def step(self) -> float:
        t0 = time.perf_counter()
        x, y = self.batch()
        with use_kernels(not self.reference):
            with fp8_autocast(fp8_recipe=self.recipe):
                _, loss = self.model(x, y)
            loss.backward()  # the FP8 step (history, scales, statistics) closes when backward ends
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


@contextlib.contextmanager
def use_kernels(enabled: bool):
    """The dispatch as it is (the fused CPU kernel where it builds), or the PyTorch references."""
    if enabled:
        yield
    else:
        with reference_kernels():
            yield


def main() -> None:
    p = modes_parser(__doc__, rounds=10, block=10, warmup=5, batch_size=16)
    p.add_argument(
        "--reference",
        action="store_true",
        help="also run both modes on the PyTorch references (base-ref, quality-ref): before the fused kernel",
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "quality_overhead.json"))
    args = p.parse_args()

    modes = MODES + (REFERENCE_MODES if args.reference else ())
    fused = has_kernel("quantize", "cpu")  # builds the fused CPU kernel now, outside the timed steps
    jobs = {m: Job(m, args) for m in modes}
    warm_up(jobs.values(), args.warmup)
    widths = {m: get_fp8_state(jobs[m].model).last_stats.shape[1] for m in modes}
    assert all(widths[m] == (10 if m.startswith("quality") else 6) for m in modes), widths  # as they say
    timings = interleave({m: jobs[m].step for m in modes}, args.rounds, args.block)
    times = timings.steps
    n_tensors = len(tensor_table(jobs["base"].model))

    med = {m: statistics.median(v) for m, v in times.items()}
    mean = {m: statistics.fmean(v) for m, v in times.items()}

    paired = timings.paired
    print(
        f"tiny GPT, batch {args.batch_size} x {args.seq_len}, torch threads {torch.get_num_threads()}, "
        f"{args.rounds} rounds x {args.block} steps per mode, {n_tensors} tensors quantized per step; "
        f"CPU quantize: {'fused kernel' if fused else 'PyTorch reference (the fused kernel did not build)'}"
        + (", *-ref: PyTorch reference" if args.reference else "")
    )
    print(f"{'mode':<12} {'median ms':>10} {'mean ms':>10} {'steps':>6}")
    for m in modes:
        print(f"{m:<12} {med[m] * 1e3:10.2f} {mean[m] * 1e3:10.2f} {len(times[m]):6d}")
    ratio = paired("quality", "base")
    overall = mean["quality"] / mean["base"]
    print(
        f"quality/base: paired (median over rounds) {ratio:.3f}, overall mean {overall:.3f}, "
        f"median {med['quality'] / med['base']:.3f}; goal <= 1.03: "
        f"{'met' if ratio <= 1.03 else 'NOT met'}"
    )
    ratios = {"quality/base": ratio}
    if args.reference:
        for a, b in (("quality-ref", "base-ref"), ("base", "base-ref"), ("quality", "quality-ref")):
            ratios[f"{a}/{b}"] = paired(a, b)
            print(f"{a}/{b}: paired {ratios[f'{a}/{b}']:.3f}")
    result = {
        "machine": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "args": vars(args),
        "fused_cpu_kernel": fused,
        "load_average": os.getloadavg(),
        "tensors": n_tensors,
        "median_ms": {m: med[m] * 1e3 for m in modes},
        "mean_ms": {m: mean[m] * 1e3 for m in modes},
        "ratio_paired_median": ratio,
        "ratios_paired_median": ratios,
        "ratio_mean": overall,
        "step_times_s": times,
    }
    write_json(Path(args.out), result, indent=1)
    print_load_average()


if __name__ == "__main__":
    main()
