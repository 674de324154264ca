"""Steps read back from the database as the detector engine's input, to bring a restored engine up to date.

A run's detector state is written back every few batches (`detector_cache.CHECKPOINT_BATCHES`, ...), not after
every one. An engine restored from that checkpoint (after a restart, on another server instance, after its
cache entry was evicted) is behind by the steps processed since: they are stored, so it runs them again
from the `steps` and `step_stats` rows, in step order, and their findings are dropped (they were recorded
as alerts when the steps first came). Client events carry no detector state (`DetectorEngine.process_events`
turns each into findings on its own) and are not read again.

Steps are grouped as ingest hands them over: consecutive steps that carried the same statistics columns
(the quality columns or not; none for a step in which no FP8 layer ran) make one `StepBatch`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from fp8_protocol.codec import decode_float
from fp8_protocol.stats import BASE_COLUMNS, STAT_COLUMNS
from monitor_server.detectors.types import StepBatch
from monitor_server.storage.models import StepRow
from monitor_server.storage.stat_rows import STAT_IDS, read_step_stats_each

#: steps read and run at a time (bounds the memory of a long replay)
CHUNK_STEPS = 512


def stored_batches(
    session: Session, *, run_id: int, after: int | None, upto: int, num_tensors: int
) -> Iterator[StepBatch]:
    """The run's stored steps in (after, upto], ascending, as the batches ingest would have handed over."""
    lo = -(2**62) if after is None else after + 1
    while lo <= upto:
        rows = session.execute(
            select(StepRow.step, StepRow.scalars)
            .where(StepRow.run_id == run_id, StepRow.step.between(lo, upto))
            .order_by(StepRow.step)
            .limit(CHUNK_STEPS)
        ).all()
        if not rows:
            return
        yield from _batches(session, run_id, rows, num_tensors)
        lo = int(rows[-1].step) + 1


def _batches(
    session: Session, run_id: int, rows: Sequence[Row[int, Any]], num_tensors: int
) -> Iterator[StepBatch]:
    steps = np.fromiter((r.step for r in rows), np.int64, len(rows))
    ids = {name: STAT_IDS[name] for name in STAT_COLUMNS}
    present_steps, values = read_step_stats_each(
        session, run_id, sorted(ids.values()), int(steps[0]), int(steps[-1]), num_tensors
    )
    # per step, which columns it stored, and the row of each column's matrix holding it
    where: dict[str, np.ndarray] = {}
    for name, metric in ids.items():
        pos = np.full(len(steps), -1, dtype=np.int64)
        if metric in present_steps:
            pos[np.searchsorted(steps, present_steps[metric])] = np.arange(len(present_steps[metric]))
        where[name] = pos
    signature = [tuple(name for name in STAT_COLUMNS if where[name][i] >= 0) for i in range(len(steps))]
    scalars = [{k: decode_float(v, null_as_nan=True) for k, v in (r.scalars or {}).items()} for r in rows]
    start = 0
    for i in range(1, len(steps) + 1):
        if i < len(steps) and signature[i] == signature[start]:
            continue
        yield _batch(
            steps[start:i], scalars[start:i], signature[start], where, values, ids, start, num_tensors
        )
        start = i


def _batch(
    steps: np.ndarray,
    scalars: list[dict[str, float]],
    columns: tuple[str, ...],
    where: dict[str, np.ndarray],
    values: dict[int, np.ndarray],
    ids: dict[str, int],
    start: int,
    num_tensors: int,
) -> StepBatch:
    n = len(steps)
    if columns:
        stats = {name: values[ids[name]][where[name][start : start + n]] for name in columns}
        has_stats = None
    else:  # steps without statistics: placeholders, as a decoded batch has them
        stats = {name: np.full((n, num_tensors), np.nan) for name in BASE_COLUMNS}
        has_stats = np.zeros(n, dtype=bool)
    names = sorted({k for sc in scalars for k in sc})
    return StepBatch(
        steps=steps,
        scalars={
            name: np.array([sc.get(name, np.nan) for sc in scalars], dtype=np.float64) for name in names
        },
        stats=stats,
        present={name: np.array([name in sc for sc in scalars], dtype=bool) for name in names},
        has_stats=has_stats,
    )
