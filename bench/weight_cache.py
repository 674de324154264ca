"""Benchmark: what quantizing each weight once per optimizer step (not once per micro-batch) saves a
training step with gradient accumulation.

The same FP8 run (tiny GPT, delayed scaling, ``--grad-accum`` micro-batches per step) in two modes, in one
process, interleaved in blocks so that drift of the machine hits both alike:

* ``cached``   - the default: a layer's weight is quantized by the step's first micro-batch and its FP8 copy
  reused by the others (``fp8_trainer.linear``);
* ``uncached`` - ``FP8State.weight_cache.enabled = False``: quantized at every micro-batch, as before the
  cache.

Both train their own copy of the model from the same seed on the same batches and must reach the same
weights bit for bit (checked at the end: the cache changes no value).

    .venv/bin/python bench/weight_cache.py [--rounds 8] [--block 4] [--grad-accum 4]

Prints median step times and the paired ratio cached/uncached (median over rounds of each round's ratio);
writes bench/results/weight_cache.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import TinyGPTJob, modes_parser, print_load_average, warm_up, write_json  # noqa: E402
from bench.interleaved import interleave  # noqa: E402
from fp8_trainer import fp8_autocast  # noqa: E402
from fp8_trainer.convert import get_fp8_state  # noqa: E402

MODES = ("cached", "uncached")


class Job(TinyGPTJob):
    """One mode's model (its weight cache on or off), optimizer and data stream."""

    def __init__(self, mode: str, args: argparse.Namespace):
        super().__init__(args)
        get_fp8_state(self.model).weight_cache.enabled = mode == "cached"

    def step(self) -> float:
        a = self.args
        t0 = time.perf_counter()
        for micro in range(a.grad_accum):
            x, y = self.batch()
            with fp8_autocast(fp8_recipe=self.recipe, step_boundary=micro == a.grad_accum - 1):
                _, loss = self.model(x, y)
            (loss / a.grad_accum).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def main() -> None:
    p = modes_parser(__doc__, rounds=8, block=4, warmup=2, batch_size=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "weight_cache.json"))
    args = p.parse_args()

    jobs = {m: Job(m, args) for m in MODES}
    warm_up(jobs.values(), args.warmup)
    timings = interleave({m: jobs[m].step for m in MODES}, args.rounds, args.block)
    same = all(
        torch.equal(p, q)
        for p, q in zip(jobs["cached"].model.parameters(), jobs["uncached"].model.parameters(), strict=True)
    )
    med = {m: timings.median(m) for m in MODES}
    ratio = timings.paired("cached", "uncached")
    print(
        f"tiny GPT, delayed scaling, {args.grad_accum} micro-batches of {args.batch_size} x {args.seq_len} "
        f"per step, torch threads {torch.get_num_threads()}, {args.rounds} rounds x {args.block} steps a mode"
    )
    for m in MODES:
        print(f"{m:<10} median {med[m] * 1e3:8.2f} ms per step ({len(timings.steps[m])} steps)")
    print(f"cached/uncached: paired (median over rounds) {ratio:.3f}; same weights at the end: {same}")
    result = {
        "machine": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "args": vars(args),
        "load_average": os.getloadavg(),
        "median_ms": {m: med[m] * 1e3 for m in MODES},
        "ratio_paired_median": ratio,
        "same_weights": same,
        "step_times_s": timings.steps,
    }
    write_json(Path(args.out), result, indent=1)
    print_load_average()
    if not same:
        sys.exit("the cached run's weights differ from the uncached run's")


if __name__ == "__main__":
    main()
