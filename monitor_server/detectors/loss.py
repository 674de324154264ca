"""Loss-spike detector: robust z-score of each new loss against the trend, not against the raw window.

Training loss falls, steeply at first: against the median and MAD of the raw losses of the last 50 steps, a
jump that doubles the loss late in a steep phase scores below the threshold (the median sits above the
current level and the trend itself inflates the MAD). The loss is therefore detrended first: each loss is
compared with a short exponential moving average (the baseline, i.e. the loss expected at this step), and
the residuals ``loss - baseline`` are what the robust z-score is computed over.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from .config import DetectorConfig
from .state import decode_array, encode_array, encode_evidence
from .types import Finding

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
#: a loss moves the baseline by at most this many robust sigmas (times the EMA's alpha): a spike must not
#: drag the expectation it is measured against, while a lasting level shift is followed within a few spans
BASELINE_CLIP_SIGMAS = 3.0
TAIL = 10  # evidence carries this many previous losses


class LossSpikeDetector:
    """Rule, for each new finite loss x at step s:

    - ``r = x - b`` with ``b`` the baseline before s: an exponential moving average of the losses with
      ``alpha = 2 / (loss_ema_span + 1)`` (the first loss starts it);
    - ``z = (r - median(R)) / max(1.4826 * MAD(R), loss_rel_floor * |b|, 1e-12)`` with R the residuals of the
      previous `loss_window` finite losses (their median absorbs the EMA's lag behind a falling loss);
    - fires when ``z >= loss_z_threshold`` and R holds at least `loss_min_history` residuals; critical when
      ``z >= loss_z_critical``. Only upward spikes count; consecutive spiking steps are one finding (at the
      first of them).

    The baseline then moves by ``alpha * clip(r, median(R) +- 3 sigma)``, so one spike barely moves it and
    a lasting level shift stops alerting after a few spans. Non-finite losses are the nonfinite detector's
    business (they are skipped here).
    """

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.alpha = 2.0 / (config.loss_ema_span + 1.0)
        self.baseline: float | None = None
        self.resid: list[float] = []  # residuals of the previous finite losses, oldest first
        self.steps: list[int] = []  # steps and losses of the last TAIL finite losses (evidence)
        self.losses: list[float] = []
        self.active = False  # the previous finite loss was a spike
        self.last_scored: int | None = None  # the latest step whose loss had enough history to be scored

    def process(self, steps: np.ndarray, loss: np.ndarray) -> list[Finding]:
        cfg = self.config
        findings = []
        for step, x in zip(steps.tolist(), loss.tolist(), strict=True):
            if not math.isfinite(x):
                continue
            if self.baseline is None:
                self.baseline = x
                self._remember(step, x, None)
                continue
            b = self.baseline
            r = x - b
            clipped = r
            if len(self.resid) >= cfg.loss_min_history:
                med = statistics.median(self.resid)
                mad = statistics.median([abs(v - med) for v in self.resid])
                sigma = max(MAD_TO_SIGMA * mad, cfg.loss_rel_floor * abs(b), 1e-12)
                z = (r - med) / sigma
                self.last_scored = step
                spike = z >= cfg.loss_z_threshold
                if spike and not self.active:
                    findings.append(self._finding(step, x, b, r, med, mad, sigma, z))
                self.active = spike
                clipped = min(max(r, med - BASELINE_CLIP_SIGMAS * sigma), med + BASELINE_CLIP_SIGMAS * sigma)
            self.baseline = b + self.alpha * clipped
            if not math.isfinite(self.baseline):  # losses near the float64 limit: start again from this one
                self.baseline = x
            self._remember(step, x, r)
        return findings

    def _remember(self, step: int, x: float, r: float | None) -> None:
        if r is not None:
            self.resid.append(r)
            del self.resid[: -self.config.loss_window]
        self.steps.append(step)
        self.losses.append(x)
        del self.steps[:-TAIL], self.losses[:-TAIL]

    def _finding(self, step, x, b, r, med, mad, sigma, z) -> Finding:
        cfg = self.config
        severity = "critical" if z >= cfg.loss_z_critical else "warning"
        return Finding(
            kind="loss_spike",
            step=step,
            severity=severity,
            tensor_index=None,
            message=(
                f"loss spike at step {step}: loss {x:.6g} is {z:.1f} robust sigmas above its trend "
                f"(expected {b + med:.6g} +- {sigma:.3g} from the previous {len(self.resid)} losses)"
            ),
            evidence=encode_evidence(
                {
                    "loss": x,
                    "baseline": b,
                    "expected": b + med,
                    "residual": r,
                    "median_residual": med,
                    "mad": mad,
                    "sigma": sigma,
                    "z": z,
                    "threshold": cfg.loss_z_threshold,
                    "window_len": len(self.resid),
                    "ema_span": cfg.loss_ema_span,
                    "tail_steps": list(self.steps),
                    "tail_loss": list(self.losses),
                }
            ),
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "resid": encode_array(np.asarray(self.resid, dtype=np.float64)),
            "steps": encode_array(np.asarray(self.steps, dtype=np.int64)),
            "loss": encode_array(np.asarray(self.losses, dtype=np.float64)),
            "active": self.active,
            "last_scored": self.last_scored,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = decode_array(state["steps"], np.int64).tolist()[-TAIL:]
        self.losses = decode_array(state["loss"], np.float64).tolist()
        self.active = bool(state["active"])
        self.last_scored = state.get("last_scored")
        if "resid" in state:
            self.baseline = state["baseline"]
            self.resid = decode_array(state["resid"], np.float64).tolist()
        else:  # saved by the raw-window detector: rebuild the baseline from the losses it kept
            self.baseline, self.resid = None, []
            for x in self.losses:
                if self.baseline is not None:
                    self.resid.append(x - self.baseline)
                    self.baseline += self.alpha * (x - self.baseline)
                else:
                    self.baseline = x
        self.losses = self.losses[-TAIL:]
