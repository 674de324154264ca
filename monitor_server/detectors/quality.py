"""Quantization-quality detectors: a tensor whose SQNR falls well below its own recent level.

A tensor's signal-to-quantization-noise ratio (``10·log10(Σx² / Σ(q(x)−x)²)``, from the ``sum_sq`` and
``err_sq`` columns) sits at a level set by its distribution and its format (about 25-35 dB for E4M3 with a
well-chosen scale). When it falls far below that level, FP8 is losing the tensor's information (a scale
pinned by a spike flushes its bulk to subnormals, an outlier feature stretches the range) and the layer is
diverging, often before anything saturates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fp8_protocol.stats import no_finite_element, sqnr_db

from .base import BatchView, Detector, array_state, nested_state
from .episodes import advance
from .per_tensor import firings
from .tensors import Tail
from .types import Finding

_CHUNK_CELLS = 1 << 18  # window values sorted at once: a long batch sorts in cache-sized pieces


def rolling_median(ext: np.ndarray, window: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """For i < rows, the median and the count of the non-NaN values in ``ext[i : i + window]`` (per column).

    The windows are sorted as float32 (numpy sorts float32 rows of a few dozen values an order of magnitude
    faster than float64 ones; an SQNR in dB keeps 1e-6 dB of it), so the median is float32-exact.

    Args:
        ext: (window + rows, T) float64, NaN where there is no value.

    Returns:
        median (rows, T) float64 (NaN where the count is 0) and count (rows, T) int64.
    """
    n = ext.shape[1]
    median = np.full((n, rows), np.nan)
    # tensor-major, so each window is a contiguous run of `window` values
    with np.errstate(over="ignore"):
        by_tensor = np.ascontiguousarray(ext.T, dtype=np.float32)  # (T, window + rows)
    present = np.zeros((n, window + rows + 1), dtype=np.int64)  # present[:, p]: values in by_tensor[:, :p]
    np.cumsum(~np.isnan(by_tensor), axis=1, out=present[:, 1:])
    count = present[:, window : window + rows] - present[:, :rows]
    views = np.lib.stride_tricks.sliding_window_view(by_tensor, window, axis=1)  # (T, rows + 1, window)
    step = max(1, _CHUNK_CELLS // max(1, n * window))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        block = np.sort(views[:, lo:hi], axis=-1)  # NaN sorts last
        k = count[:, lo:hi]
        low = np.take_along_axis(block, (np.maximum(k - 1, 0) // 2)[..., None], axis=-1)[..., 0]
        high = np.take_along_axis(block, (k // 2)[..., None], axis=-1)[..., 0]
        mid = (low.astype(np.float64) + high.astype(np.float64)) / 2.0
        median[:, lo:hi] = np.where(k > 0, mid, np.nan)
    return median.T, count.T


@dataclass(eq=False)
class SqnrDropDetector(Detector, key="sqnr_drop", order=55):
    """Rule: a tensor's SQNR in dB against its own recent level, the median of its SQNR over the previous
    `sqnr_window` steps in which it was `watched` (FP8 on, past its warm-up) and finite. A step drops when
    ``level - sqnr > sqnr_drop_db`` and at least `sqnr_min_history` steps make up the level; fires once per
    episode of consecutive dropping steps, after `sqnr_consecutive` of them, severity warning, critical
    when the drop exceeds ``2 * sqnr_drop_db``. The dropped steps enter the window too, so a tensor that
    settles at a new level ends its episode once the median has followed it (a further fall fires again).
    Steps without the quality columns, and an undefined SQNR (a tensor without a finite element, NaN) or an
    exact round trip (+inf), are skipped: they neither drop nor enter the level.
    """

    # (sqnr_window, T) previous usable SQNR values, NaN where none; a changed sqnr_window restarts the window
    ring: np.ndarray = array_state(np.float64, keep_on_reshape=True)
    run: np.ndarray = array_state(np.int64)  # (T,) length of the open episode
    fired: np.ndarray = array_state(bool)  # (T,) fired in the open episode
    last_sqnr: np.ndarray = array_state(np.float64)  # (T,) latest defined SQNR (+inf kept), for layer health
    # (T,) whether the latest step with a verdict had no finite element (its SQNR NaN: nothing measured)
    last_nonfinite: np.ndarray = array_state(bool, optional=True)
    level: np.ndarray = array_state(np.float64)  # (T,) the recent level at the latest usable step
    tail: Tail = nested_state()  # SQNR values, for evidence

    def __post_init__(self) -> None:
        n = len(self.tensors)
        self.ring = np.full((self.config.sqnr_window, n), np.nan)
        self.run = np.zeros(n, dtype=np.int64)
        self.fired = np.zeros(n, dtype=bool)
        self.last_sqnr = np.full(n, np.nan)
        self.last_nonfinite = np.zeros(n, dtype=bool)
        self.level = np.full(n, np.nan)
        self.tail = Tail(n)

    def observe(self, view: BatchView) -> list[Finding]:
        sum_sq, err_sq = view.stats.get("sum_sq"), view.stats.get("err_sq")
        if sum_sq is None or err_sq is None:
            return []
        numel, nonfinite = view.stats.get("numel"), view.stats.get("nonfinite")
        sqnr = sqnr_db(sum_sq, err_sq, numel, nonfinite)
        dead = None if numel is None or nonfinite is None else no_finite_element(numel, nonfinite)
        return self.process(view.steps, sqnr, view.watched, dead)

    def process(
        self, steps: np.ndarray, sqnr: np.ndarray, watched: np.ndarray, dead: np.ndarray | None = None
    ) -> list[Finding]:
        """``dead``: (S, T) where a tensor had no finite element (its SQNR NaN because nothing was measured,
        not because the step sent no quality statistics)."""
        cfg = self.config
        s_len, n = sqnr.shape
        w = cfg.sqnr_window
        self.tail.push(steps, sqnr)
        usable = np.isfinite(sqnr) & watched
        ext = np.concatenate([self.ring, np.where(usable, sqnr, np.nan)])  # (W + S, T)
        level, count = rolling_median(ext, w, s_len)  # step i's window is ext[i : i + W]
        drop = level - sqnr
        valid = usable & (count >= cfg.sqnr_min_history)
        with np.errstate(invalid="ignore"):
            mask = valid & (drop > cfg.sqnr_drop_db)
        cols, run, (fire,) = advance(
            mask, self.run, [self.fired], lambda run, c: [run >= cfg.sqnr_consecutive]
        )
        self.ring = ext[-w:].copy()
        dead = np.zeros(sqnr.shape, dtype=bool) if dead is None else dead
        defined = ~np.isnan(sqnr) | dead
        last = s_len - 1 - np.argmax(defined[::-1], axis=0)
        seen = defined.any(axis=0)
        self.last_sqnr = np.where(seen, sqnr[last, np.arange(n)], self.last_sqnr)
        self.last_nonfinite = np.where(seen, dead[last, np.arange(n)], self.last_nonfinite)
        last_valid = s_len - 1 - np.argmax(valid[::-1], axis=0)
        self.level = np.where(valid.any(axis=0), level[last_valid, np.arange(n)], self.level)

        findings = []
        for f in firings(fire, cols, run, steps, self.tensors):
            s, t = f.s, f.t
            message = (
                f"SQNR drop in {f.name} at step {f.step}: {sqnr[s, t]:.1f} dB, {drop[s, t]:.1f} dB below "
                f"its recent level of {level[s, t]:.1f} dB (median of {count[s, t]} steps), more "
                f"than {cfg.sqnr_drop_db:g} dB, for {f.run} steps"
            )
            evidence = {
                **f.at(sqnr_db=sqnr, level_db=level, drop_db=drop),
                "threshold_db": cfg.sqnr_drop_db,
                "level_steps": count[s, t],
                "consecutive_steps": f.run,
                "sqnr_tail": self.tail.get(s, t),
            }
            severity = "critical" if drop[s, t] > 2 * cfg.sqnr_drop_db else "warning"
            findings.append(f.finding("sqnr_drop", severity, message, evidence))
        return findings
