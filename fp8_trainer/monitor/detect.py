"""Client-side detection (loss spikes, non-finite loss or statistics) and the flight recorder.

The detectors run on host data one step late (what ``Monitor.step`` already has), so they cost a few
microseconds per step and never touch the device. When one fires, the event carries the flight recorder:
the last ``flight_steps`` steps of every statistic and scalar at full resolution, so a post-mortem has the
run-up even if the job dies right after.

Loss spike: the rule the service uses too (``fp8_protocol.loss_spike``): a robust z-score of each new finite
loss's residual against a short EMA of the loss, over the residuals of the previous ``loss_window`` losses;
once per run of consecutive spiking steps.

Non-finite: a NaN/inf loss, or a tensor whose ``nonfinite`` count is > 0 or whose amax is not finite;
fires when the set of such tensors grows (or the loss turns non-finite), not on every step of a NaN run.
"""

from __future__ import annotations

import base64
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8_protocol.client_events import LOSS_SPIKE_EVENT, NONFINITE_EVENT
from fp8_protocol.codec import encode_float
from fp8_protocol.loss_spike import LossSpikeParams, LossSpikeRule
from fp8_protocol.stats import AMAX, NONFINITE, OVERFLOW, STAT_COLUMNS, UNDERFLOW

from .sender import StepRecord


@dataclass
class DetectConfig:
    # the shared rule's defaults (the service's too), so both sides agree on what a spike is
    loss_window: int = LossSpikeParams.window
    loss_min_history: int = LossSpikeParams.min_history
    loss_z_threshold: float = LossSpikeParams.z_threshold
    loss_rel_floor: float = LossSpikeParams.rel_floor
    loss_ema_span: int = LossSpikeParams.ema_span
    flight_steps: int = 64
    max_involved: int = 8


def pack_matrix(m: np.ndarray) -> dict[str, Any]:
    """A (rows, cols) float64 matrix, little-endian row-major, base64 (NaN/inf native)."""
    m = np.ascontiguousarray(m, dtype="<f8")
    return {"dtype": "float64", "shape": list(m.shape), "b64": base64.b64encode(m.tobytes()).decode("ascii")}


class FlightRecorder:
    """The last K steps of statistics and scalars, kept on the host."""

    def __init__(self, k: int):
        self.records: deque[StepRecord] = deque(maxlen=k)

    def push(self, rec: StepRecord) -> None:
        self.records.append(rec)

    def last_steps(self) -> list[dict[str, Any]]:
        """Per recorded step, readable at a glance: its scalars, the max amax over tensors and the summed
        overflow / underflow / nonfinite counts."""
        out = []
        for r in self.records:
            row: dict[str, Any] = {"step": r.step, **{k: encode_float(v) for k, v in r.scalars.items()}}
            if r.stats is not None and r.stats.size:
                row["max_amax"] = encode_float(float(np.max(r.stats[:, AMAX])))
                for j, name in ((OVERFLOW, "overflow"), (UNDERFLOW, "underflow"), (NONFINITE, "nonfinite")):
                    row[name] = encode_float(float(np.sum(r.stats[:, j])))
            out.append(row)
        return out

    def dump(self, tensor_names: list[str], involved: list[int]) -> dict[str, Any]:
        """``{"steps", "scalars": {name: [K]}, "stats": {stat: packed (K, T)}, "tensors": [...]}``;
        ``tensors`` repeats the involved tensors' series as plain JSON for quick reading."""
        recs = list(self.records)
        if not recs:
            return {"steps": [], "scalars": {}, "stats": {}, "tensors": []}
        T = next((r.stats.shape[0] for r in recs if r.stats is not None), 0)
        # the columns every record has: the quality columns only where no record came without them
        width = min((r.stats.shape[1] for r in recs if r.stats is not None), default=len(STAT_COLUMNS))
        missing = np.full((T, width), np.nan)  # a step in which no FP8 layer ran
        stack = np.stack([r.stats[:, :width] if r.stats is not None else missing for r in recs])  # (K, T, C)
        cols = STAT_COLUMNS[:width]
        names = sorted({k for r in recs for k in r.scalars})
        out = {
            "steps": [r.step for r in recs],
            "scalars": {n: [encode_float(float(r.scalars.get(n, np.nan))) for r in recs] for n in names},
            "stats": {s: pack_matrix(stack[:, :, j]) for j, s in enumerate(cols)},
            "tensors": [
                {
                    "index": i,
                    "name": tensor_names[i] if i < len(tensor_names) else str(i),
                    **{s: [encode_float(float(v)) for v in stack[:, i, j]] for j, s in enumerate(cols)},
                }
                for i in involved
            ],
        }
        return out


class Detector:
    """Loss-spike and non-finite detection over host records (see the module docstring)."""

    def __init__(self, cfg: DetectConfig, order: list[int] | None = None):
        self.cfg = cfg
        # forward-then-backward order of the tensors (inputs and weights by layer, then gradients in reverse
        # layer order): the order in which a non-finite value spreads, so its first entry is the culprit
        self.rank = {t: r for r, t in enumerate(order or [])}
        self.loss_rule = LossSpikeRule(LossSpikeParams.of(cfg))
        self.loss_nonfinite = False
        self.bad_tensors: set[int] = set()
        #: (step, tensor index) of the run's first non-finite statistics: the culprit, first in the order
        #: a non-finite value spreads; None while there has been none
        self.first_nonfinite: tuple[int, int] | None = None

    def check(self, rec: StepRecord) -> list[tuple[str, dict[str, Any], list[int]]]:
        """Events for this step: ``(kind, details, involved tensor indices)``."""
        out = []
        if rec.stats is not None and rec.stats.size:
            self._check_stats(rec, out)
        loss = rec.scalars.get("loss")
        if loss is not None:
            loss = float(loss)
            if not math.isfinite(loss):
                if not self.loss_nonfinite:
                    out.append((NONFINITE_EVENT, {"what": "loss", "loss": encode_float(loss)}, []))
                self.loss_nonfinite = True
            else:
                self.loss_nonfinite = False
                spike = self._spike(loss)
                if spike is not None:
                    out.append((LOSS_SPIKE_EVENT, spike, []))  # the monitor adds the amax movers
        return out

    def _check_stats(self, rec: StepRecord, out: list) -> None:
        amax, nonfinite = rec.stats[:, AMAX], rec.stats[:, NONFINITE]
        if not self.bad_tensors and nonfinite.max() <= 0 and np.isfinite(amax.sum()):
            return  # the common case, checked in two vector operations
        bad = set(np.flatnonzero((nonfinite > 0) | ~np.isfinite(amax)).tolist())
        new = sorted(bad - self.bad_tensors, key=lambda t: (self.rank.get(t, t), t))
        self.bad_tensors = bad
        if new:
            if self.first_nonfinite is None:
                self.first_nonfinite = (int(rec.step), int(new[0]))
            details = {
                "what": "statistics",
                "tensor_index": new[0],  # the service's detectors attach the alert to this tensor
                "tensor_indices": new,
                "nonfinite_counts": [encode_float(float(nonfinite[i])) for i in new],
            }
            out.append(("nonfinite", details, new[: self.cfg.max_involved]))

    def _spike(self, loss: float) -> dict[str, Any] | None:
        score = self.loss_rule.update(loss)
        if score is None or not score.spike:
            return None
        return {
            "loss": loss,
            "expected": score.expected,
            "baseline": score.baseline,
            "sigma": score.sigma,
            "z": score.z,
            "threshold": self.cfg.loss_z_threshold,
            "window_len": score.window_len,
        }


def amax_movers(recorder: FlightRecorder, rec: StepRecord, n: int) -> list[int]:
    """The ``n`` tensors whose log2 amax moved most from their median over the recorded steps."""
    past = [r.stats[:, AMAX] for r in recorder.records if r.stats is not None]
    if not past or rec.stats is None or not rec.stats.size:
        return []
    hist = np.stack(past)  # (K, T)
    amax = rec.stats[:, AMAX]
    with np.errstate(divide="ignore", invalid="ignore"):
        move = np.abs(np.log2(amax) - np.log2(np.median(hist, axis=0)))
    move = np.where(np.isnan(amax) | np.isposinf(amax), np.inf, move)
    move = np.nan_to_num(move, nan=0.0, posinf=np.inf)  # 0 -> 0 (an FP8-off layer) is no move
    order = np.argsort(-move, kind="stable")
    return [int(i) for i in order[:n] if move[i] > 0]
