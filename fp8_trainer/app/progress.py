"""What an ``fp8-train`` run shows while it trains (a progress bar, or log lines), and the monitor that
stands in when it reports nowhere."""

from __future__ import annotations

import os
import sys
import time

import torch
from tqdm import tqdm

from ..hostcopy import LateCopy
from ..stats import read_newest
from .report import fp8_summary
from .train_config import TrainConfig

__all__ = ["NoMonitor", "Progress"]


class _Lagged:
    """A device scalar read on the host one step late, so showing it never stalls the GPU."""

    def __init__(self):
        self._late = LateCopy()

    def push(self, t: torch.Tensor) -> float | None:
        previous = self._late.swap(t)
        return None if previous is None else previous[1].item()  # started a step ago: complete


def _terminal_width() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


class Progress:
    """What a run shows per step: a progress bar on a terminal, else a log line every ``log_interval`` steps
    (with the FP8 summary of the newest step), rank 0 only. ``say`` prints a line either way."""

    def __init__(self, a: TrainConfig, start: int, tokens_per_step: int, lead: bool, out):
        self.a, self.start, self.tokens_per_step, self.lead, self.out = a, start, tokens_per_step, lead, out
        show_bar = lead and a.progress and sys.stderr.isatty()
        width = _terminal_width() if show_bar else 0
        self.bar = tqdm(
            total=a.steps,
            initial=start,
            unit="step",
            file=sys.stderr,
            disable=not show_bar,
            # a terminal that reports no size (some ptys) would hide the bar: assume 100 x 24 there
            dynamic_ncols=width > 0,
            ncols=None if width > 0 else 100,
            nrows=None if width > 0 else 24,
        )
        self.lagged, self.smooth_tps = _Lagged(), None
        self.t_start = time.perf_counter()

    def say(self, line: str) -> None:
        if self.lead and self.bar.disable:
            self.out(line)
        elif self.lead:
            tqdm.write(line, file=sys.stdout)

    def show(
        self,
        step: int,
        loss: torch.Tensor,
        lr: float,
        now: float,
        tokens_per_s: float,
        monitor,
        model,
        recipe,
    ):
        """After optimizer step ``step`` (``now``: the host clock then)."""
        a = self.a
        if not self.bar.disable:
            shown = self.lagged.push(loss)  # the loss of the step before: no stall
            tps = self.smooth_tps
            self.smooth_tps = tokens_per_s if tps is None else 0.9 * tps + 0.1 * tokens_per_s
            postfix = {"tok/s": f"{self.smooth_tps:,.0f}", "incidents": monitor.open_incidents}
            if shown is not None:
                postfix = {"loss": f"{shown:.4f}", **postfix}
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update()
        elif self.lead and (step % a.log_interval == 0 or step == a.steps):
            elapsed = now - self.t_start  # averages since the start: steady numbers
            done = step - self.start
            line = f"step {step:5d}  loss {loss.item():.4f}  lr {lr:.3g}"
            line += f"  {elapsed / done * 1e3:.0f} ms/step"
            line += f"  {self.tokens_per_step * done / elapsed:,.0f} tok/s"
            if a.monitor_url:  # incidents, as the dashboard groups the alerts: one NaN is one, not dozens
                line += f"  incidents {monitor.open_incidents}"
                if monitor.open_alerts:
                    line += f" ({monitor.open_alerts} alerts)"
            self.say(line)
            if recipe is not None and step != a.steps:
                got = read_newest(model)  # synchronous, at log intervals only
                if got is not None:
                    self.say("           " + fp8_summary(got[1]))

    def close(self) -> None:
        self.bar.close()


class NoMonitor:
    """Stands in for ``fp8_trainer.Monitor`` when no ``--monitor-url`` is given."""

    open_alerts = 0
    open_incidents = 0
    first_nonfinite = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self, step: int, **scalars) -> None:
        pass

    def event(self, kind: str, step: int, **details) -> None:
        pass

    def close(self, status: str = "finished") -> None:
        pass

    run_id = dashboard_url = None
