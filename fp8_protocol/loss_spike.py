"""The loss-spike rule, shared by the training client (which sends a ``loss_spike`` event with its flight
recorder) and the service (which raises the alert), so that both call the same losses a spike.

Training loss falls, steeply at first: against the median and MAD of the raw losses of the last 50 steps, a
jump that doubles the loss late in a steep phase scores below the threshold (the median sits above the
current level and the trend itself inflates the MAD). Each loss is therefore compared with a short
exponential moving average (the baseline, the loss expected at this step), and the robust z-score is
computed over the residuals ``loss - baseline``.

Rule, for each new finite loss x:

- ``r = x - b`` with ``b`` the baseline before x: an exponential moving average of the losses with
  ``alpha = 2 / (ema_span + 1)`` (the first loss starts it);
- ``z = (r - median(R)) / max(1.4826 * MAD(R), rel_floor * |b|, 1e-12)`` with R the residuals of the
  previous ``window`` finite losses (their median absorbs the EMA's lag behind a falling loss);
- a spike when ``z >= z_threshold`` and R holds at least ``min_history`` residuals. Only upward spikes
  count; consecutive spiking losses are one spike (reported at the first of them).

The baseline then moves by ``alpha * clip(r, median(R) +- 3 sigma)``, so one spike barely moves it and a
lasting level shift stops counting after a few spans. Non-finite losses are skipped (they are the
non-finite detectors' business).

Pure Python on short lists: a few microseconds per loss, cheaper than numpy at this size.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
#: a loss moves the baseline by at most this many robust sigmas (times the EMA's alpha): a spike must not
#: drag the expectation it is measured against, while a lasting level shift is followed within a few spans
BASELINE_CLIP_SIGMAS = 3.0


@dataclass(frozen=True)
class LossSpikeParams:
    """The rule's parameters, and the defaults of both sides' detector configurations."""

    window: int = 50
    min_history: int = 20
    z_threshold: float = 6.0
    rel_floor: float = 1e-3
    ema_span: int = 10

    @classmethod
    def of(cls, config: Any) -> LossSpikeParams:
        """From a detector configuration's ``loss_window``, ``loss_min_history``, ``loss_z_threshold``,
        ``loss_rel_floor`` and ``loss_ema_span`` (the client's and the service's are named alike)."""
        return cls(
            window=config.loss_window,
            min_history=config.loss_min_history,
            z_threshold=config.loss_z_threshold,
            rel_floor=config.loss_rel_floor,
            ema_span=config.loss_ema_span,
        )


@dataclass(frozen=True)
class Score:
    """How one finite loss scored: ``spike`` is true only at the first of consecutive spiking losses."""

    loss: float
    baseline: float
    residual: float
    median_residual: float
    mad: float
    sigma: float
    z: float
    window_len: int
    spike: bool

    @property
    def expected(self) -> float:
        """The loss the rule expected at this step (baseline plus the typical residual)."""
        return self.baseline + self.median_residual


@dataclass
class LossSpikeRule:
    """The rule's running state (see the module docstring). ``update`` feeds one loss."""

    params: LossSpikeParams = field(default_factory=LossSpikeParams)
    baseline: float | None = None
    resid: list[float] = field(default_factory=list)  # residuals of the previous finite losses, oldest first
    active: bool = False  # the previous scored loss was a spike

    @property
    def alpha(self) -> float:
        return 2.0 / (self.params.ema_span + 1.0)

    def update(self, x: float) -> Score | None:
        """Feed one loss; its score, or None when it was not scored (non-finite, or too little history)."""
        if not math.isfinite(x):
            return None
        if self.baseline is None:
            self.baseline = x
            return None
        p = self.params
        b = self.baseline
        r = x - b
        clipped = r
        score = None
        if len(self.resid) >= p.min_history:
            med = statistics.median(self.resid)
            mad = statistics.median([abs(v - med) for v in self.resid])
            sigma = max(MAD_TO_SIGMA * mad, p.rel_floor * abs(b), 1e-12)
            z = (r - med) / sigma
            spiking = z >= p.z_threshold
            score = Score(x, b, r, med, mad, sigma, z, len(self.resid), spiking and not self.active)
            self.active = spiking
            clipped = min(max(r, med - BASELINE_CLIP_SIGMAS * sigma), med + BASELINE_CLIP_SIGMAS * sigma)
        self.baseline = b + self.alpha * clipped
        if not math.isfinite(self.baseline):  # losses near the float64 limit: start again from this one
            self.baseline = x
        self.resid.append(r)
        del self.resid[: -p.window]
        return score

    def replay(self, losses: list[float]) -> None:
        """Rebuild the baseline and residuals from raw losses (no scoring, no spike state)."""
        self.baseline, self.resid = None, []
        for x in losses:
            if not math.isfinite(x):
                continue
            if self.baseline is not None:
                self.resid.append(x - self.baseline)
                del self.resid[: -self.params.window]
                self.baseline += self.alpha * (x - self.baseline)
            else:
                self.baseline = x
