"""Rank divergence: one data-parallel rank whose amaxes disagree with the other ranks'.

The training client samples every rank's own (pre-reduction) amax of every tensor every N steps and sends
them as a ``rank_amax`` event: ``details = {"world_size": W, "amax": [[T floats] x W]}`` (non-finite values
as the wire strings). With amax reduction, the reduced amax every rank uses is the max over ranks, so one
rank seeing much larger values (bad data shard, a flipped bit, a broken device) silently rescales everybody;
this detector names that rank.

Rule, per tensor: ``d_r = log2(amax_r) - median over the other ranks of log2(amax)``; a rank diverges when
``|d_r| > rank_divergence_log2`` (warning) or ``> 2 * rank_divergence_log2`` (critical), and always (critical)
when its amax is non-finite while some other rank's is finite. Zero amaxes on every rank (FP8 off, unused
layer) are skipped; a zero on one rank only counts as infinitely far below. One finding per diverging tensor,
naming the worst rank (with two ranks both deviate equally: the one above is named).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .state import encode_evidence
from .types import Finding, TensorMeta, decode_float, encode_float

__all__ = ["parse_rank_amax", "rank_divergence"]


def parse_rank_amax(details: dict[str, Any], n_tensors: int) -> np.ndarray:
    """The (W, T) float64 amax matrix of a ``rank_amax`` event; ValueError if it is malformed."""
    rows = details.get("amax")
    if not isinstance(rows, list) or len(rows) < 2:
        raise ValueError("rank_amax: 'amax' must be a list of at least two per-rank lists")
    world = details.get("world_size", len(rows))
    if world != len(rows):
        raise ValueError(f"rank_amax: world_size {world} but {len(rows)} rows")
    out = np.empty((len(rows), n_tensors), dtype=np.float64)
    for r, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != n_tensors:
            raise ValueError(f"rank_amax: row {r} must hold {n_tensors} values")
        try:
            out[r] = [decode_float(v) for v in row]
        except (KeyError, TypeError):
            raise ValueError(f"rank_amax: row {r} holds a value that is not a number") from None
    return out


def rank_divergence(
    amax: np.ndarray,
    tensors: list[TensorMeta],
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
    findings = []
    with np.errstate(divide="ignore", invalid="ignore"):
        log_a = np.log2(np.abs(amax))
    for t in range(n):
        if skip is not None and skip[t]:
            continue
        col, logs = amax[:, t], log_a[:, t]
        finite = np.isfinite(col)
        if finite.all() and not (col > 0).any():
            continue  # all zero: nothing quantized
        worst_rank, worst_dev, severity = None, 0.0, None
        for r in range(world):
            others = np.delete(logs, r)
            others_finite = np.delete(finite, r)
            if not finite[r]:
                if others_finite.any():
                    worst_rank, worst_dev, severity = r, float("inf"), "critical"
                    break
                continue
            ref = others[np.isfinite(others)]
            if ref.size == 0:
                continue
            dev = float(logs[r] - np.median(ref))
            # ties (two ranks: both sides deviate equally) go to the rank above: its amax rescales everyone
            if abs(dev) > threshold_log2 and (abs(dev), dev) > (abs(worst_dev), worst_dev):
                worst_rank, worst_dev = r, dev
                severity = "critical" if abs(dev) > 2 * threshold_log2 else "warning"
        if worst_rank is None:
            continue
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
                evidence=encode_evidence(
                    {
                        "rank": worst_rank,
                        "deviation_log2": encode_float(worst_dev),
                        "amax_per_rank": [encode_float(v) for v in col],
                    }
                ),
            )
        )
    return findings
