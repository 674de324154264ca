"""Bounded storage: compaction of per-step statistics into the rollups.

With ``raw_steps_kept`` = N, a run keeps its statistics per step for its last N steps (at least; the cut
falls on a block of `rollups.COMPACT_BLOCK` steps); older steps are kept only in the rollups, which were
written at ingest and cover the whole run at 8 steps and coarser. The heatmap of a compacted range reads them
(max / min / sum, NaN kept, as before), at 8-step resolution or coarser; the per-step export
(`export.py`) has the kept steps only. The block scale exponent histograms of the compacted steps are
summed per tensor and block of `COMPACT_BLOCK` steps (`block_hist.compact_histograms`): the histogram of a
compacted range stays exact, at 8-step resolution or coarser. The steps' scalars (loss, lr, ...) are small
and stay, with their series. The service runs `compact` in its periodic maintenance.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, func, select

from monitor_server.core.db import Database
from monitor_server.storage.block_hist import compact_histograms
from monitor_server.storage.models import Run, StepStat
from monitor_server.storage.rollups import COMPACT_BLOCK
from monitor_server.storage.stat_rows import STAT_IDS

log = logging.getLogger("fp8scope.monitor")


def compaction_cut(last_step: int, keep: int) -> int:
    """The first step that keeps its per-step statistics, for a run whose last step is `last_step`."""
    return max(0, (last_step + 1 - keep) // COMPACT_BLOCK * COMPACT_BLOCK)


def compact(db: Database, keep: int) -> dict[int, int]:
    """Drop the per-step statistics of every run older than its last `keep` steps (0: keep everything).

    One short write transaction per run that has something to drop. Returns {run id: rows deleted}
    (statistics rows, and per-step block histograms folded into their 8-step sums).
    """
    if keep <= 0:
        return {}
    with db.read_session() as session:
        runs = session.execute(select(Run.id, Run.last_step).where(Run.last_step.is_not(None))).all()
    done: dict[int, int] = {}
    amax = STAT_IDS["amax"]
    for run_id, last_step in runs:
        cut = compaction_cut(int(last_step), keep)
        if cut == 0:
            continue
        with db.write() as session:
            first = session.scalar(
                select(func.min(StepStat.step)).where(StepStat.run_id == run_id, StepStat.metric == amax)
            )
            if first is None or first >= cut:
                continue
            result = session.execute(
                delete(StepStat).where(
                    StepStat.run_id == run_id,
                    StepStat.metric.in_(sorted(STAT_IDS.values())),
                    StepStat.step < cut,
                )
            )
            done[run_id] = result.rowcount + compact_histograms(session, run_id, cut)
    for run_id, rows in done.items():
        log.info(
            "run %d: per-step statistics before its last %d steps compacted (%d rows)", run_id, keep, rows
        )
    return done
