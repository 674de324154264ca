"""Scalar series (loss, lr, ...): step ranges, reads and min/max-preserving downsampling."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import orjson
from sqlalchemy import Text, case, select, type_coerce
from sqlalchemy.orm import Session

from fp8_protocol.codec import NONFINITE_SPELLING, jsonable
from monitor_server.storage.models import StepRow
from monitor_server.storage.query_schemas import SeriesPoints

P = TypeVar("P", bound=SeriesPoints)


def scalar_value(raw: object) -> float | None:
    """A stored scalar as a float: numbers, and the wire's non-finite strings; None for anything else."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int | float):
        return float(raw)
    if isinstance(raw, str):
        return NONFINITE_SPELLING.get(raw)
    return None


def step_range(first: int | None, last: int | None, lo: int | None, hi: int | None) -> tuple[int, int] | None:
    """The requested step range [lo, hi] (None: open) clipped to the stored one [first, last]; None when
    nothing is stored or the clipped range is empty."""
    if first is None or last is None:
        return None
    lo = first if lo is None else max(lo, first)
    hi = last if hi is None else min(hi, last)
    return (lo, hi) if lo <= hi else None


def read_series(
    session: Session, run_id: int, names: Sequence[str], rng: tuple[int, int] | None
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per scalar name, (steps, values) for the stored steps in `rng` = [lo, hi] (None: no step); steps
    lacking it are left out.

    One pass over the steps whatever the number of names. The loss alone reads its own column (the finite
    loss) and parses the scalars only of the rows without one (a non-finite loss).
    """
    if rng is None:
        return {name: (np.zeros(0, np.int64), np.zeros(0, np.float64)) for name in names}
    where = (StepRow.run_id == run_id, StepRow.step.between(*rng))
    if list(names) == ["loss"]:
        rows = session.execute(
            select(StepRow.step, StepRow.loss, case((StepRow.loss.is_(None), StepRow.scalars), else_=None))
            .where(*where)
            .order_by(StepRow.step)
        ).all()
        return {
            "loss": _arrays(
                (s, v if v is not None else scalar_value((sc or {}).get("loss"))) for s, v, sc in rows
            )
        }
    # the JSON as text, parsed here by orjson: several times faster than the driver's json.loads
    raw = session.execute(
        select(StepRow.step, type_coerce(StepRow.scalars, Text)).where(*where).order_by(StepRow.step)
    ).all()
    rows = [(s, orjson.loads(sc) if isinstance(sc, str | bytes) else sc) for s, sc in raw]
    return {name: _arrays((s, scalar_value((sc or {}).get(name))) for s, sc in rows) for name in names}


def _arrays(pairs: Iterable[tuple[int, float | None]]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the pairs whose value is not None."""
    kept = [(s, v) for s, v in pairs if v is not None]
    steps = np.fromiter((p[0] for p in kept), np.int64, len(kept))
    values = np.fromiter((p[1] for p in kept), np.float64, len(kept))
    return steps, values


def downsample_minmax(
    steps: np.ndarray, values: np.ndarray, max_points: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Keep at most `max_points` points: per step bucket its min and its max point, in step order.

    A bucket holding a NaN keeps a NaN point instead of its min (NaN is never dropped). Returns
    (steps, values, bucket width in steps; 1 when nothing was dropped).
    """
    n = len(steps)
    if n <= max_points:
        return steps, values, 1
    n_buckets = max(1, max_points // 2)
    lo = int(steps[0])
    width = max(1, math.ceil((int(steps[-1]) - lo + 1) / n_buckets))
    buckets = (steps - lo) // width
    order = np.lexsort((values, buckets))  # NaN sorts last inside each bucket
    sorted_b = buckets[order]
    starts = np.flatnonzero(np.r_[True, sorted_b[1:] != sorted_b[:-1]])
    ends = np.r_[starts[1:], n] - 1
    nan_counts = np.add.reduceat(np.isnan(values[order]).astype(np.int64), starts)
    keep = []
    for s, e, k in zip(starts.tolist(), ends.tolist(), nan_counts.tolist(), strict=True):
        if k == 0:
            keep += [order[s], order[e]]
        else:
            keep.append(order[e - k + 1])  # a NaN point
            if k < e - s + 1:
                keep.append(order[e - k])  # the largest non-NaN point
    idx = np.unique(np.array(keep, dtype=np.int64))
    return steps[idx], values[idx], width


def series_points(
    steps: np.ndarray, values: np.ndarray, max_points: int, model: type[P] = SeriesPoints, **fields: Any
) -> P:
    """A scalar's points as the API answers them: downsampled to at most `max_points` (`downsample_minmax`),
    non-finite values as their wire strings; as `model` (`SeriesPoints`, or `SeriesPublic` given its other
    `fields`), so a long series is validated once."""
    kept_steps, kept_values, width = downsample_minmax(steps, values, max_points)
    return model(
        **fields,
        bucket_width=width,
        downsampled=len(kept_steps) < len(steps),
        steps=kept_steps.tolist(),
        values=jsonable(kept_values.tolist()),
    )
