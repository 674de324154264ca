"""Loss-spike detector: the shared rule (`fp8_protocol.loss_spike`, a robust z-score of each new loss against
its trend) turned into findings with evidence, and its state kept across batches and restarts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fp8_protocol.loss_spike import LossSpikeParams, LossSpikeRule, Score

from .config import DetectorConfig
from .state import decode_array, encode_array, encode_evidence
from .types import Finding

TAIL = 10  # evidence carries this many previous losses


class LossSpikeDetector:
    """Runs `fp8_protocol.loss_spike.LossSpikeRule` with the run's detector config; a spike is a finding,
    critical when ``z >= loss_z_critical``."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.rule = LossSpikeRule(LossSpikeParams.of(config))
        self.steps: list[int] = []  # steps and losses of the last TAIL finite losses (evidence)
        self.losses: list[float] = []
        self.last_scored: int | None = None  # the latest step whose loss had enough history to be scored

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
            evidence=encode_evidence(
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

    def state_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.rule.baseline,
            "resid": encode_array(np.asarray(self.rule.resid, dtype=np.float64)),
            "steps": encode_array(np.asarray(self.steps, dtype=np.int64)),
            "loss": encode_array(np.asarray(self.losses, dtype=np.float64)),
            "active": self.rule.active,
            "last_scored": self.last_scored,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = decode_array(state["steps"], np.int64).tolist()[-TAIL:]
        losses = decode_array(state["loss"], np.float64).tolist()
        self.rule.active = bool(state["active"])
        self.last_scored = state.get("last_scored")
        if "resid" in state:
            self.rule.baseline = state["baseline"]
            self.rule.resid = decode_array(state["resid"], np.float64).tolist()
        else:  # saved by the raw-window detector: rebuild the baseline from the losses it kept
            self.rule.replay(losses)
        self.losses = losses[-TAIL:]
