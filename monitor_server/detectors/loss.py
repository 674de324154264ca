"""Loss-spike detector: the shared rule (`fp8_protocol.loss_spike`, a robust z-score of each new loss against
its trend) turned into findings with evidence, and its state kept across batches and restarts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8_protocol.codec import jsonable
from fp8_protocol.loss_spike import LossSpikeParams, LossSpikeRule, Score

from .base import BatchView, Detector, Stateful, array_state, nested_state, value_state
from .types import Finding

TAIL = 10  # evidence carries this many previous losses


@dataclass
class _PersistentRule(LossSpikeRule, Stateful):
    """The shared rule with its running state marked for the detector's state dict. baseline and resid
    are optional: the raw-window detector saved neither (`LossSpikeDetector.load_state_dict`)."""

    baseline: float | None = value_state(optional=True, default=None)
    resid: list[float] = array_state(np.float64, as_list=True, optional=True, default_factory=list)
    active: bool = value_state(bool, default=False)


@dataclass(eq=False)
class LossSpikeDetector(Detector, key="loss", order=20):
    """Runs `fp8_protocol.loss_spike.LossSpikeRule` with the run's detector config; a spike is a finding,
    critical when ``z >= loss_z_critical``."""

    # the rule's keys (baseline, resid, active) sit beside the detector's own in its state dict
    rule: _PersistentRule = nested_state(flatten=True)
    # steps and losses of the last TAIL finite losses (evidence)
    steps: list[int] = array_state(np.int64, as_list=True, default_factory=list)
    losses: list[float] = array_state(np.float64, as_list=True, stored_as="loss", default_factory=list)
    # the latest step whose loss had enough history to be scored
    last_scored: int | None = value_state(optional=True, default=None)

    def __post_init__(self) -> None:
        self.rule = _PersistentRule(LossSpikeParams.of(self.config))

    def observe(self, view: BatchView) -> list[Finding]:
        return [] if view.loss is None else self.process(view.steps, view.loss)

    def process(self, steps: np.ndarray, loss: np.ndarray) -> list[Finding]:
        findings = []
        for step, x in zip(steps.tolist(), loss.tolist(), strict=True):
            score = self.rule.update(x)
            if score is not None:
                self.last_scored = step
                if score.spike:
                    findings.append(self._finding(step, score))
            if math.isfinite(x):
                self._remember(step, x)
        return findings

    def _remember(self, step: int, x: float) -> None:
        self.steps.append(step)
        self.losses.append(x)
        del self.steps[:-TAIL], self.losses[:-TAIL]

    def _finding(self, step: int, s: Score) -> Finding:
        cfg = self.config
        severity = "critical" if s.z >= cfg.loss_z_critical else "warning"
        return Finding(
            kind="loss_spike",
            step=step,
            severity=severity,
            tensor_index=None,
            message=(
                f"loss spike at step {step}: loss {s.loss:.6g} is {s.z:.1f} robust sigmas above its trend "
                f"(expected {s.expected:.6g} +- {s.sigma:.3g} from the previous {s.window_len} losses)"
            ),
            evidence=jsonable(
                {
                    "loss": s.loss,
                    "baseline": s.baseline,
                    "expected": s.expected,
                    "residual": s.residual,
                    "median_residual": s.median_residual,
                    "mad": s.mad,
                    "sigma": s.sigma,
                    "z": s.z,
                    "threshold": cfg.loss_z_threshold,
                    "window_len": s.window_len,
                    "ema_span": cfg.loss_ema_span,
                    "tail_steps": list(self.steps),
                    "tail_loss": list(self.losses),
                }
            ),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "resid" not in state:  # saved by the raw-window detector: rebuild the baseline from its losses
            self.rule.replay(self.losses)
        del self.steps[:-TAIL], self.losses[:-TAIL]
