"""Scaling-state detectors: amax divergence (growth delayed scaling cannot cover) and scale collapse."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import BatchView, Detector, array_state, nested_state
from .episodes import advance
from .per_tensor import by_role, firings
from .tensors import Tail
from .types import Finding

# log2 amax is kept in fixed point (2^-20 resolution) so that window sums are exact integer arithmetic:
# the same steps give bit-identical means however the run was split into batches.
FIXED_POINT = float(2**20)


@dataclass(eq=False)
class AmaxDivergenceDetector(Detector, key="divergence", order=50):
    """Rule: ``growth = log2(amax_s) - mean(log2 amax over the previous W steps)`` with
    ``W = min(amax_history_len, divergence_window)`` per tensor (the recompute interval, usually 1, for
    ``amax_compute_algo="most_recent"``; see `recipe.growth_window`). Only steps where the tensor is
    `watched` (FP8 on and past its warm-up) enter the window, so the steep first steps of a run are no
    baseline. A step diverges when
    ``growth > margin + tol`` (``tol``: `divergence_log2`, `divergence_log2_grad` for grad_output) and at
    least half the window holds finite amaxes; fires once per
    episode after `divergence_consecutive` diverging steps, severity warning, critical when
    ``growth > margin + 2 * tol``. A steady exponential rise of r (log2 per step) gives
    growth of about ``r * (W + 1) / 2``.
    """

    # previous log2 amax per tensor, fixed point, oldest first; (T, W) so window sums run along rows. A
    # changed divergence_window restarts the window.
    ring_q: np.ndarray = array_state(np.int32, keep_on_reshape=True)
    ring_ok: np.ndarray = array_state(bool, keep_on_reshape=True)  # (T, W) ring_q holds a usable amax
    run: np.ndarray = array_state(np.int64)  # (T,) length of the open episode
    fired: np.ndarray = array_state(bool)  # (T,) fired in the open episode
    last_growth: np.ndarray = array_state(np.float64)  # (T,) latest growth, for layer health
    tail: Tail = nested_state()  # amaxes, for evidence

    def __post_init__(self) -> None:
        cfg = self.config
        n, w = len(self.tensors), cfg.divergence_window
        self.ring_q = np.zeros((n, w), dtype=np.int32)
        self.ring_ok = np.zeros((n, w), dtype=bool)
        self.run = np.zeros(n, dtype=np.int64)
        self.fired = np.zeros(n, dtype=bool)
        self.last_growth = np.full(n, np.nan)
        self.tol = by_role(self.tensors, cfg.divergence_log2, cfg.divergence_log2_grad)
        self.tail = Tail(n)

    def observe(self, view: BatchView) -> list[Finding]:
        amax = view.stats.get("amax")
        if amax is None:
            return []
        return self.process(view.steps, amax, view.watched, view.margin, view.window)

    def process(self, steps, amax, watched, margin, window) -> list[Finding]:
        cfg = self.config
        s_len, n = amax.shape
        w = cfg.divergence_window
        self.tail.push(steps, amax)
        with np.errstate(over="ignore"):  # beyond float32: inf, i.e. unusable, like the runtime's own value
            amax32 = amax.astype(np.float32)  # the runtime's amax is float32; its log2 is ~2x cheaper
        ok = np.isfinite(amax32) & (amax32 > 0) & watched
        log2_32 = np.log2(amax32, where=ok, out=np.zeros_like(amax32))  # 0 where unusable, so q is 0 there
        q = (log2_32 * np.float32(FIXED_POINT)).astype(np.int32)  # exact scaling, then truncation; |q| < 2^28
        log2_amax = log2_32.astype(np.float64)
        log2_amax[~ok] = np.nan
        ext_q = np.concatenate([self.ring_q, q.T], axis=1)  # (T, W + S)
        ext_ok = np.concatenate([self.ring_ok, ok.T], axis=1)
        cum_q = np.zeros((n, w + s_len + 1), dtype=np.int64)  # cum_q[:, p] = sum of ext_q[:, :p]
        cum_n = np.zeros((n, w + s_len + 1), dtype=np.int64)
        np.cumsum(ext_q, axis=1, dtype=np.int64, out=cum_q[:, 1:])
        np.cumsum(ext_ok, axis=1, out=cum_n[:, 1:])
        total = np.empty((n, s_len), dtype=np.int64)
        count = np.empty((n, s_len), dtype=np.int64)
        for u in np.unique(window):  # usually one window length for the whole model
            rows = slice(None) if (window == u).all() else window == u
            # step i's window is ext[:, w + i - u : w + i]
            total[rows] = cum_q[rows, w : w + s_len] - cum_q[rows, w - u : w - u + s_len]
            count[rows] = cum_n[rows, w : w + s_len] - cum_n[rows, w - u : w - u + s_len]
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = (total / (count * FIXED_POINT)).T  # (S, T)
        growth = log2_amax - mean
        valid = ok & (window <= 2 * count.T)  # at least half the window has finite amaxes
        mask = valid & (growth > margin[None, :] + self.tol[None, :])
        cols, run, (fire,) = advance(
            mask, self.run, [self.fired], lambda run, c: [run >= cfg.divergence_consecutive]
        )
        self.ring_q = ext_q[:, -w:].copy()
        self.ring_ok = ext_ok[:, -w:].copy()
        has = valid.any(axis=0)
        last_valid = s_len - 1 - np.argmax(valid[::-1], axis=0)
        self.last_growth = np.where(has, growth[last_valid, np.arange(n)], self.last_growth)

        findings = []
        for f in firings(fire, cols, run, steps, self.tensors):
            s, t, r, m, tol = f.s, f.t, f.run, margin[f.t], self.tol[f.t]
            message = (
                f"amax divergence in {f.name} at step {f.step}: amax {amax[s, t]:.4g} is "
                f"2^{growth[s, t]:.2f} "
                f"times the mean of the previous {window[t]} steps (2^{mean[s, t]:.2f}), beyond the "
                f"margin {m:g} + tolerance {tol:g}, for {r} steps"
            )
            evidence = {
                **f.at(amax=amax, log2_amax=log2_amax, window_mean_log2_amax=mean, growth_log2=growth),
                "window": window[t],
                "margin": m,
                "tolerance_log2": tol,
                "consecutive_steps": r,
                "amax_tail": self.tail.get(s, t),
            }
            severity = "critical" if growth[s, t] > m + 2 * tol else "warning"
            findings.append(f.finding("amax_divergence", severity, message, evidence))
        return findings


@dataclass(eq=False)
class ScaleCollapseDetector(Detector, key="scale_collapse", order=30):
    """Rule: a step's scale has collapsed when ``max(log2 scale over the previous scale_window steps) -
    log2(scale) > scale_drop_log2`` (warning: one amax spike in a ``"max"`` history pins a tiny scale for
    amax_history_len steps, flushing everything else to zero), or when the scale is NaN/±inf, <= 0 or below
    `scale_min` (critical). Fires once per episode, and once more if a warning episode turns critical. The
    drop counts only where `watched` (past the warm-up: the first scales fall from the initial 1 by design);
    a broken scale counts wherever the tensor is `enabled`.
    """

    # (scale_window, T) previous scales, NaN where unusable; a changed scale_window restarts the window
    ring: np.ndarray = array_state(np.float64, keep_on_reshape=True)
    run: np.ndarray = array_state(np.int64)  # (T,) length of the open episode
    fired: np.ndarray = array_state(bool)  # (T,) fired in the open episode
    fired_critical: np.ndarray = array_state(bool)  # (T,) fired as critical in the open episode
    tail: Tail = nested_state()  # scales, for evidence

    def __post_init__(self) -> None:
        n = len(self.tensors)
        self.ring = np.full((self.config.scale_window, n), np.nan)
        self.run = np.zeros(n, dtype=np.int64)
        self.fired = np.zeros(n, dtype=bool)
        self.fired_critical = np.zeros(n, dtype=bool)
        self.tail = Tail(n)

    def observe(self, view: BatchView) -> list[Finding]:
        scale = view.stats.get("scale")
        if scale is None:
            return []
        return self.process(view.steps, scale, view.enabled, view.watched)

    def process(self, steps, scale, enabled, watched=None) -> list[Finding]:
        cfg = self.config
        self.tail.push(steps, scale)
        s_len = scale.shape[0]
        usable = np.isfinite(scale) & (scale > 0)
        scale_or_nan = np.where(usable, scale, np.nan)
        ext = np.concatenate([self.ring, scale_or_nan])
        ref = ext[:s_len].copy()
        for j in range(1, cfg.scale_window):  # sliding max over the previous window; fmax skips NaN
            np.fmax(ref, ext[j : j + s_len], out=ref)
        dropped = scale_or_nan * 2.0**cfg.scale_drop_log2 < ref  # False where either is NaN
        broken = ~usable | (scale < cfg.scale_min)
        mask = enabled & broken | (enabled if watched is None else watched) & dropped
        cols, run, (fire, escalate) = advance(
            mask, self.run, [self.fired, self.fired_critical], lambda run, c: [mask[:, c], broken[:, c]]
        )
        self.ring = ext[-cfg.scale_window :].copy()

        findings = []
        for f in firings(fire | escalate, cols, run, steps, self.tensors):
            s, t = f.s, f.t
            critical = bool(broken[s, t])
            with np.errstate(divide="ignore", invalid="ignore"):
                drop = float(np.log2(ref[s, t] / scale[s, t]))
            if critical:
                how = f"scale is {scale[s, t]:.4g} (non-finite, non-positive or below {cfg.scale_min:.3g})"
            else:
                how = (
                    f"scale fell 2^{drop:.1f}x to {scale[s, t]:.4g} within {cfg.scale_window} steps "
                    f"(more than 2^{cfg.scale_drop_log2:g})"
                )
            evidence = {
                **f.at(scale=scale, window_max_scale=ref),
                "drop_log2": drop,
                "drop_threshold_log2": cfg.scale_drop_log2,
                "scale_min": cfg.scale_min,
                "window": cfg.scale_window,
                "scale_tail": self.tail.get(s, t),
            }
            message = f"scale collapse in {f.name} at step {f.step}: {how}"
            severity = "critical" if critical else "warning"
            findings.append(f.finding("scale_collapse", severity, message, evidence))
        return findings
