"""Benchmark: what the telemetry client costs a training step.

The same FP8 run (tiny GPT, delayed scaling, statistics for every tensor at every step) in three modes, in
one process, interleaved in blocks so that drift of the machine hits every mode alike:

* ``off``  - no monitor;
* ``on``   - a `fp8_trainer.Monitor` streaming to a real `fp8-monitor serve` on this machine (SQLite);
* ``dead`` - a Monitor pointed at an address where nothing listens (it spools to a temporary folder).

Each mode trains its own copy of the model (same seed). A pause after each block lets background sending
finish outside the timed region of the next block, so the comparison charges each mode for its own work.

    .venv/bin/python bench/overhead.py [--rounds 8] [--block 15] [--batch-size 16] [--seq-len 64]

Prints median and mean step times and the ratios on/off and dead/off, overall and paired by round (the
median over rounds of each round's ratio, robust to the machine's drift); writes
bench/results/overhead.json.
Goal: both ratios <= 1.02 on the CPU.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import TinyGPTJob, modes_parser, warm_up, write_json  # noqa: E402
from bench.interleaved import interleave  # noqa: E402
from fp8_trainer import fp8_autocast, tensor_table  # noqa: E402
from fp8_trainer.monitor import Monitor  # noqa: E402
from tests.support.server import free_port, running_server  # noqa: E402

MODES = ("off", "on", "dead")


class Job(TinyGPTJob):
    """One mode's model, optimizer, data stream and (optional) monitor."""

    def __init__(self, mode: str, url: str | None, spool_dir: Path, args: argparse.Namespace):
        super().__init__(args)
        self.step_no = 0
        self.monitor = None
        if url is not None:
            tuning = {"flush_interval": args.flush_interval} if args.flush_interval else {}
            self.monitor = Monitor(
                url,
                f"overhead-{mode}",
                self.model,
                self.recipe,
                spool_path=spool_dir / f"{mode}.jsonl",
                **tuning,
            )

    def step(self) -> float:
        t0 = time.perf_counter()
        x, y = self.batch()
        with fp8_autocast(fp8_recipe=self.recipe):
            _, loss = self.model(x, y)
        loss.backward()  # the FP8 step (history, scales, statistics) closes when backward ends
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1
        if self.monitor is not None:
            self.monitor.step(self.step_no, loss=loss.detach(), lr=1e-3, grad_norm=grad_norm)
        return time.perf_counter() - t0


def main() -> None:
    p = modes_parser(__doc__, rounds=8, block=15, warmup=5, batch_size=16)
    p.add_argument("--pause", type=float, default=1.0, help="seconds between blocks (untimed)")
    p.add_argument("--flush-interval", type=float, default=None, help="the Monitor's (default: its own, 1 s)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp, running_server(f"sqlite:///{tmp}/bench.db") as server:
        spool = Path(tmp)
        urls = {"off": None, "on": server.url, "dead": f"http://127.0.0.1:{free_port()}"}
        jobs = {m: Job(m, urls[m], spool, args) for m in MODES}
        warm_up(jobs.values(), args.warmup)
        time.sleep(args.pause)
        timings = interleave({m: jobs[m].step for m in MODES}, args.rounds, args.block, pause=args.pause)
        times = timings.steps
        for job in jobs.values():
            if job.monitor is not None:
                job.monitor.close()
        n_tensors = len(tensor_table(jobs["off"].model))

    med = {m: statistics.median(v) for m, v in times.items()}
    mean = {m: statistics.fmean(v) for m, v in times.items()}
    paired = {m: timings.paired(m, "off") for m in MODES}
    rows = [(m, med[m] * 1e3, mean[m] * 1e3, mean[m] / mean["off"], paired[m], len(times[m])) for m in MODES]
    print(
        f"tiny GPT, batch {args.batch_size} x {args.seq_len}, torch threads {torch.get_num_threads()}, "
        f"{args.rounds} rounds x {args.block} steps per mode, {n_tensors} tensors monitored"
    )
    print(f"{'mode':<6} {'median ms':>10} {'mean ms':>10} {'mean/off':>9} {'paired':>7} {'steps':>6}")
    for m, a, b, ratio, pr, n in rows:
        print(f"{m:<6} {a:10.2f} {b:10.2f} {ratio:9.3f} {pr:7.3f} {n:6d}")
    print("paired = median over rounds of (this mode's block mean / the off block's mean in the same round)")
    print(
        f"goal: on/off and dead/off <= 1.02 -> paired on {paired['on']:.3f}, dead {paired['dead']:.3f}; "
        f"overall on {mean['on'] / mean['off']:.3f}, dead {mean['dead'] / mean['off']:.3f}"
    )
    result = {
        "machine": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "args": vars(args),
        "tensors": n_tensors,
        "median_ms": {m: med[m] * 1e3 for m in MODES},
        "mean_ms": {m: mean[m] * 1e3 for m in MODES},
        "ratio_mean": {m: mean[m] / mean["off"] for m in MODES},
        "ratio_paired_median": paired,
        "step_times_s": times,
    }
    write_json(ROOT / "bench" / "results" / "overhead.json", result, indent=1)


if __name__ == "__main__":
    main()
