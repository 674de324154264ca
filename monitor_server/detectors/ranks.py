"""Rank divergence: one data-parallel rank whose amaxes disagree with the other ranks'.

The training client samples every rank's own (pre-reduction) amax of every tensor every N steps and sends
them as a ``rank_amax`` event (`fp8_protocol.client_events`: ``details = {"world_size": W, "amax": [[T
floats] x W]}``, non-finite values as the wire strings; `parse_rank_amax` reads it). With amax reduction,
the reduced amax every rank uses is the max over ranks, so one rank seeing much larger values (bad data
shard, a flipped bit, a broken device) silently rescales everybody; this detector names that rank.

Rule, per tensor: ``d_r = log2(amax_r) - median over the other ranks of log2(amax)``; a rank diverges when
``|d_r| > rank_divergence_log2`` (warning) or ``> 2 * rank_divergence_log2`` (critical), and always (critical)
when its amax is non-finite while some other rank's is finite. Zero amaxes on every rank (FP8 off, unused
layer) are skipped; a zero on one rank only counts as infinitely far below. One finding per diverging tensor,
naming the worst rank (with two ranks both deviate equally: the one above is named).
"""

from __future__ import annotations

import warnings

import numpy as np

from fp8_protocol.codec import encode_float, jsonable
from fp8_protocol.tensors import TensorInfo

from .types import Finding

__all__ = ["rank_divergence"]


def rank_divergence(
    amax: np.ndarray,
    tensors: list[TensorInfo],
    step: int,
    threshold_log2: float,
    skip: np.ndarray | None = None,
) -> list[Finding]:
    """Findings for the tensors on which one rank diverges from the others (see the module docstring).

    Args:
        amax: (W, T) per-rank amaxes of one step.
        skip: optional (T,) bool, tensors to ignore (layers with FP8 turned off).
    """
    world, n = amax.shape
    finite = np.isfinite(amax)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_a = np.log2(np.abs(amax))
    # the median of the other ranks' finite log2 amaxes (zeros and non-finite ones left out), all (rank,
    # tensor) pairs at once: this runs inside the ingest of the batch carrying the event
    ref = np.where(np.isfinite(log_a), log_a, np.nan)
    median_others = np.empty_like(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: no reference, no finding
        for r in range(world):
            median_others[r] = np.nanmedian(np.delete(ref, r, axis=0), axis=0)
    with np.errstate(invalid="ignore"):
        dev_all = np.where(finite, log_a - median_others, np.nan)
        over = np.abs(dev_all) > threshold_log2
    nonfinite_vs_finite = (~finite).any(axis=0) & finite.any(axis=0)
    quantized = ~(finite.all(axis=0) & ~(amax > 0).any(axis=0))  # all zero: nothing quantized
    candidates = quantized & (over.any(axis=0) | nonfinite_vs_finite)
    if skip is not None:
        candidates &= ~skip
    findings = []
    for t in np.flatnonzero(candidates).tolist():
        col = amax[:, t]
        if nonfinite_vs_finite[t]:
            worst_rank, worst_dev, severity = int(np.flatnonzero(~finite[:, t])[0]), float("inf"), "critical"
        else:
            worst_rank, worst_dev = None, 0.0
            for r in np.flatnonzero(over[:, t]).tolist():
                dev = float(dev_all[r, t])
                # ties (two ranks: both sides deviate equally) go to the rank above: it rescales everyone
                if (abs(dev), dev) > (abs(worst_dev), worst_dev):
                    worst_rank, worst_dev = r, dev
            severity = "critical" if abs(worst_dev) > 2 * threshold_log2 else "warning"
        name = tensors[t].name if t < len(tensors) else f"tensor[{t}]"
        if np.isfinite(worst_dev):
            ratio = f"{2.0**worst_dev:.3g}x the other ranks' median"
        else:
            ratio = "non-finite while other ranks' are finite"
        findings.append(
            Finding(
                kind="rank_divergence",
                step=step,
                severity=severity,
                tensor_index=t,
                message=f"rank {worst_rank} amax of {name} at step {step} is {ratio}",
                evidence=jsonable(
                    {
                        "rank": worst_rank,
                        "deviation_log2": encode_float(worst_dev),
                        "amax_per_rank": [encode_float(v) for v in col],
                    }
                ),
            )
        )
    return findings
