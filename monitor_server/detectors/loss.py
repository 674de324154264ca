"""Loss-spike detector: robust z-score of each new loss against a rolling window of previous losses."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .config import DetectorConfig
from .state import decode_array, encode_array, encode_evidence
from .types import Finding

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


class LossSpikeDetector:
    """Rule: ``z = (loss - median(W)) / max(1.4826 * MAD(W), loss_rel_floor * |median(W)|, 1e-12)`` where W
    holds the previous `loss_window` finite losses; fires when ``z >= loss_z_threshold`` and W holds at least
    `loss_min_history` losses. Only upward spikes count. Consecutive spiking steps are one finding (at the
    first of them). Spikes stay in the window: median and MAD are robust to them, and a lasting level shift
    then stops alerting after about half a window. Non-finite losses are the nonfinite detector's business.
    """

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.window_steps = np.zeros(0, dtype=np.int64)
        self.window_loss = np.zeros(0)
        self.active = False  # the previous finite loss was a spike

    def process(self, steps: np.ndarray, loss: np.ndarray) -> list[Finding]:
        cfg = self.config
        ok = np.isfinite(loss)
        new_steps, new_loss = steps[ok], loss[ok]
        if new_loss.size == 0:
            return []
        n_hist = self.window_loss.size
        ext = np.concatenate([self.window_loss, new_loss])
        ext_steps = np.concatenate([self.window_steps, new_steps])
        k = new_loss.size
        w = cfg.loss_window
        med = np.full(k, np.nan)
        mad = np.full(k, np.nan)
        count = np.minimum(np.arange(n_hist, n_hist + k), w)
        full = np.arange(n_hist, n_hist + k) >= w
        if full.any():
            rows = sliding_window_view(ext, w)[np.arange(n_hist, n_hist + k)[full] - w]  # (K', W)
            m = np.median(rows, axis=1)
            med[full] = m
            mad[full] = np.median(np.abs(rows - m[:, None]), axis=1)
        for i in np.flatnonzero(~full & (count >= cfg.loss_min_history)):
            rows = ext[max(0, n_hist + i - w) : n_hist + i]
            med[i] = np.median(rows)
            mad[i] = np.median(np.abs(rows - med[i]))
        sigma = np.maximum(np.maximum(MAD_TO_SIGMA * mad, cfg.loss_rel_floor * np.abs(med)), 1e-12)
        z = (new_loss - med) / sigma
        spike = (count >= cfg.loss_min_history) & (z >= cfg.loss_z_threshold)
        prev = np.concatenate([[self.active], spike[:-1]])
        fire = spike & ~prev
        self.active = bool(spike[-1])
        self.window_loss = ext[-w:].copy()
        self.window_steps = ext_steps[-w:].copy()

        findings = []
        for i in np.flatnonzero(fire):
            lo = max(0, n_hist + i - w)
            tail = slice(max(lo, n_hist + i - 10), n_hist + i)
            severity = "critical" if z[i] >= cfg.loss_z_critical else "warning"
            step = int(new_steps[i])
            findings.append(
                Finding(
                    kind="loss_spike",
                    step=step,
                    severity=severity,
                    tensor_index=None,
                    message=(
                        f"loss spike at step {step}: loss {new_loss[i]:.6g} is {z[i]:.1f} robust sigmas "
                        f"above the median {med[i]:.6g} of the previous {count[i]} losses"
                    ),
                    evidence=encode_evidence(
                        {
                            "loss": new_loss[i],
                            "median": med[i],
                            "mad": mad[i],
                            "sigma": sigma[i],
                            "z": z[i],
                            "threshold": cfg.loss_z_threshold,
                            "window_len": count[i],
                            "window_first_step": ext_steps[lo],
                            "tail_steps": ext_steps[tail],
                            "tail_loss": ext[tail],
                        }
                    ),
                )
            )
        return findings

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": encode_array(self.window_steps),
            "loss": encode_array(self.window_loss),
            "active": self.active,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window_steps = decode_array(state["steps"], np.int64)
        self.window_loss = decode_array(state["loss"], np.float64)
        self.active = bool(state["active"])
