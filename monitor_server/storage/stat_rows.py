"""The per-step statistics rows: one `StepStat` row per (run, statistic, step) holding the T tensors' values,
packed as float32 when every value survives that exactly, float64 otherwise (`pack`), and their reads.

The rollups over blocks of steps and the heatmap read path built on these rows are `rollups.py`.
"""

from __future__ import annotations

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from fp8_protocol.stats import (
    BASE_COLUMNS,
    BLOCK_COLUMNS,
    LEGACY_BLOCK_COLUMNS,
    QUALITY_COLUMNS,
)
from monitor_server.storage.models import StepStat

#: statistic name -> metric id of its `StepStat` rows (stored ids: never renumber). The base columns are
#: 0-5, 6 is the derived headroom (rollups only), the quality columns follow it (7-10), then, after the
#: quality metrics' rollup ids, the first five block-scaling columns (15-19); `blocks_zero`, added later,
#: after the block fractions' rollup ids (23).
STAT_IDS: dict[str, int] = (
    {name: i for i, name in enumerate(BASE_COLUMNS)}
    | {name: 7 + i for i, name in enumerate(QUALITY_COLUMNS)}
    | {name: 15 + i for i, name in enumerate(LEGACY_BLOCK_COLUMNS)}
    | {"blocks_zero": 23}
)
assert set(STAT_IDS) == set(BASE_COLUMNS + QUALITY_COLUMNS + BLOCK_COLUMNS)

_F8 = np.dtype("<f8")
_F4 = np.dtype("<f4")


def _exact_in_float32(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the rows of a float64 matrix as float32, per row: does every value survive that exactly?)"""
    narrow = matrix.astype(_F4)
    with np.errstate(invalid="ignore"):
        same = (narrow.astype(_F8) == matrix) | np.isnan(matrix)
    return narrow, same.all(axis=-1)


def pack(values: np.ndarray) -> bytes:
    """A float vector as stored: little-endian float32 when every value survives that exactly (an amax or
    scale of a float32 or bf16 tensor, counts up to 2^24, NaN, ±inf: nearly every row, at half the bytes),
    float64 otherwise (larger counts, sums). Nothing is rounded; `unpack` tells the two apart by length."""
    wide = np.ascontiguousarray(values, dtype=_F8)
    narrow, exact = _exact_in_float32(wide)
    return narrow.tobytes() if exact else wide.tobytes()


def unpack(blob: bytes, num_tensors: int) -> np.ndarray:
    """Inverse of `pack`: the T values as float64."""
    if len(blob) == 4 * num_tensors:
        return np.frombuffer(blob, dtype=_F4).astype(_F8)
    return np.frombuffer(blob, dtype=_F8)


def unpack_rows(blobs: list[bytes], num_tensors: int) -> np.ndarray:
    """Many packed rows as one (n, T) float64 matrix; one join and one conversion when they share a width."""
    n = len(blobs)
    joined = b"".join(blobs)
    if len(joined) == 4 * num_tensors * n:  # every row float32 (a row is 4T or 8T bytes)
        return np.frombuffer(joined, dtype=_F4).astype(_F8).reshape(n, num_tensors)
    if len(joined) == 8 * num_tensors * n:
        return np.frombuffer(joined, dtype=_F8).reshape(n, num_tensors)
    out = np.empty((n, num_tensors), dtype=_F8)
    for i, blob in enumerate(blobs):
        out[i] = unpack(blob, num_tensors)
    return out


def group_starts(keys: np.ndarray) -> np.ndarray:
    """Row indices where a non-decreasing key array changes value (always includes 0)."""
    return np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])


def step_stat_rows(
    run_id: int, steps: np.ndarray, stats: dict[str, np.ndarray], quality_steps: np.ndarray | None = None
) -> list[dict]:
    """The `StepStat` rows (as insert parameters) for new steps: one per statistic the steps carry
    (`quality_steps`: (S,) bool, the steps that carried the quality columns where not all did)."""
    rows = []
    step_list = steps.tolist()
    for name, metric in STAT_IDS.items():
        if name not in stats:  # the quality or block columns, from a sender that does not compute them
            continue
        matrix = np.ascontiguousarray(stats[name], dtype=_F8)
        narrow, exact = _exact_in_float32(matrix)
        carried = quality_steps if quality_steps is not None and name in QUALITY_COLUMNS else None
        rows.extend(
            {
                "run_id": run_id,
                "metric": metric,
                "step": s,
                "values": narrow[i].tobytes() if exact[i] else matrix[i].tobytes(),
            }
            for i, s in enumerate(step_list)
            if carried is None or carried[i]
        )
    return rows


def read_step_stats_each(
    session: Session, run_id: int, metric_ids: list[int], lo: int, hi: int, num_tensors: int
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Raw per-step statistics for steps [lo, hi] in one query: (metric id -> its steps (S_m,), metric id
    -> (S_m, T)), each metric with the steps that stored it (metrics with none left out)."""
    rows = session.execute(
        select(StepStat.metric, StepStat.step, StepStat.values)
        .where(StepStat.run_id == run_id, StepStat.metric.in_(metric_ids), StepStat.step.between(lo, hi))
        .order_by(StepStat.metric, StepStat.step)
    ).all()
    steps_of: dict[int, np.ndarray] = {}
    values_of: dict[int, np.ndarray] = {}
    if not rows:
        return steps_of, values_of
    metrics = np.fromiter((r.metric for r in rows), np.int64, len(rows))
    bounds = np.r_[group_starts(metrics), len(rows)]
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        part = rows[a:b]
        steps_of[int(metrics[a])] = np.fromiter((r.step for r in part), np.int64, len(part))
        values_of[int(metrics[a])] = unpack_rows([r.values for r in part], num_tensors)
    return steps_of, values_of


def read_step_stats(
    session: Session, run_id: int, metric_ids: list[int], lo: int, hi: int, num_tensors: int
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Raw per-step statistics for steps [lo, hi]: (steps (S,), metric id -> (S, T)), for the steps that
    stored every one of `metric_ids` (a step sent without the quality columns has none of theirs)."""
    present, values = read_step_stats_each(session, run_id, metric_ids, lo, hi, num_tensors)
    return on_common_steps(present, values, metric_ids, num_tensors)


def on_common_steps(
    present: dict[int, np.ndarray], values: dict[int, np.ndarray], metric_ids: list[int], num_tensors: int
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """`read_step_stats_each`'s answer cut to the steps that stored every one of `metric_ids`: (steps (S,),
    metric id -> (S, T))."""
    if not metric_ids:
        return np.zeros(0, dtype=np.int64), {}
    if not all(m in present for m in metric_ids):  # some metric stored no step of the range
        return np.zeros(0, dtype=np.int64), {m: np.zeros((0, num_tensors)) for m in metric_ids}
    steps = present[metric_ids[0]]
    for m in metric_ids[1:]:
        if not np.array_equal(present[m], steps):  # some metric lacks some steps: keep the steps all have
            steps = np.intersect1d(steps, present[m], assume_unique=True)
    out = {
        m: values[m]
        if len(present[m]) == len(steps)
        else values[m][np.isin(present[m], steps, assume_unique=True)]
        for m in metric_ids
    }
    return steps, out
