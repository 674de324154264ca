"""Block rollups of the per-tensor statistics and the heatmap read path.

Storage: beside the per-step rows (one `StepStat` row per (run, statistic, step) holding T values:
`stat_rows.py`), one `Rollup` row per (run, level, heatmap metric, block) holding the block's aggregate over
the aligned steps [block*level, (block+1)*level). Levels are 8, 64, 512 and 4096 steps. A row's T values are
stored as float32 when every one of them survives the round trip exactly, float64 otherwise (`pack`).

A block is written once, when the run's last step has moved past it (`update_rollups`); until then it is
read from the finer levels beneath (`cover`), so a live run writes one row per metric every 8 steps rather
than rewriting one per level at every step.

Aggregation never averages: amax and scale keep the bucket max, headroom the bucket min, overflow /
underflow / nonfinite the bucket sum; of the quantization-quality metrics SQNR keeps the bucket min (the
worst), subnormal fraction, dynamic range and outlier ratio the bucket max. NaN propagates through max, min
and sum (a bucket holding a NaN shows NaN) and so does an infinity.

Derived metrics (headroom, the quality metrics and the block-scaling fractions) are computed per step from
the stored columns: at ingest into the rollups, and on raw reads from the `StepStat` rows. A step stored
without the quality (or block) columns has no rows of theirs and no rollup contribution to their metrics:
their buckets hold only the steps that carried them. The block metrics (fractions of the tensor's blocks at
a scale limit, with an overflow, with an underflow, and the worst block's range in binades) keep the bucket
max.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from fp8_protocol.stats import (
    block_fraction,
    dynamic_range,
    outlier_ratio,
    sqnr_db,
    subnormal_fraction,
)
from monitor_server.storage.models import Rollup, Run, StepStat
from monitor_server.storage.stat_rows import (
    STAT_IDS,
    group_starts,
    on_common_steps,
    pack,
    read_step_stats,
    read_step_stats_each,
    unpack,
    unpack_rows,
)

#: the rollup block sizes, in steps (each divides the next)
LEVELS: tuple[int, ...] = (8, 64, 512, 4096)
#: compaction drops per-step rows in whole blocks of the smallest level, so the rollups still cover them
COMPACT_BLOCK = LEVELS[0]

#: the derived headroom (rollups only)
HEADROOM_ID = 6
#: rollup-only metric ids of the derived quantization-quality metrics (stored ids: never renumber)
SQNR_ID, SUBNORMAL_FRACTION_ID, DYNAMIC_RANGE_ID, OUTLIER_RATIO_ID = 11, 12, 13, 14
#: rollup-only metric ids of the block-scaling fractions (of the tensor's blocks; stored ids: never renumber).
#: The block range's rollups share its column's id, as amax's do.
BLOCK_AT_LIMIT_ID, BLOCK_OVERFLOW_ID, BLOCK_UNDERFLOW_ID = 20, 21, 22

#: heatmap metric -> (rollup metric id, how buckets aggregate)
HEATMAP_METRICS: dict[str, tuple[int, str]] = {
    "amax": (STAT_IDS["amax"], "max"),
    "scale": (STAT_IDS["scale"], "max"),
    "overflow": (STAT_IDS["overflow"], "sum"),
    "underflow": (STAT_IDS["underflow"], "sum"),
    "nonfinite": (STAT_IDS["nonfinite"], "sum"),
    "headroom": (HEADROOM_ID, "min"),
    "sqnr": (SQNR_ID, "min"),  # dB; the worst of the bucket
    "subnormal": (SUBNORMAL_FRACTION_ID, "max"),  # subnormal / numel
    "dynamic_range": (DYNAMIC_RANGE_ID, "max"),  # binades, log2(amax / min_abs)
    "outlier_ratio": (OUTLIER_RATIO_ID, "max"),  # amax / RMS
    "block_at_limit": (BLOCK_AT_LIMIT_ID, "max"),  # blocks_at_limit / blocks
    "block_overflow": (BLOCK_OVERFLOW_ID, "max"),  # blocks_overflow / blocks
    "block_underflow": (BLOCK_UNDERFLOW_ID, "max"),  # blocks_underflow / blocks
    "block_range": (STAT_IDS["block_range"], "max"),  # binades, the worst block's
}


def headroom(amax: np.ndarray, scale: np.ndarray, fp8_max: np.ndarray) -> np.ndarray:
    """log2(FP8_MAX / (amax * scale)) per tensor: how many binades the scaled amax sits below the format max.

    amax*scale == 0 gives +inf (nothing to overflow); an infinite amax*scale gives -inf; NaN stays NaN.
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.log2(fp8_max / (amax * scale))


#: derived metric id -> (the stored columns it is computed from, f(fp8_max, *columns) -> (S, T) per step)
DERIVED: dict[int, tuple[tuple[str, ...], Callable[..., np.ndarray]]] = {
    HEADROOM_ID: (("amax", "scale"), lambda fp8_max, amax, scale: headroom(amax, scale, fp8_max)),
    SQNR_ID: (
        ("sum_sq", "err_sq", "numel", "nonfinite"),
        lambda _, sum_sq, err_sq, numel, nonfinite: sqnr_db(sum_sq, err_sq, numel, nonfinite),
    ),
    SUBNORMAL_FRACTION_ID: (("subnormal", "numel"), lambda _, sub, numel: subnormal_fraction(sub, numel)),
    DYNAMIC_RANGE_ID: (("amax", "min_abs"), lambda _, amax, min_abs: dynamic_range(amax, min_abs)),
    OUTLIER_RATIO_ID: (
        ("amax", "sum_sq", "numel", "nonfinite"),
        lambda _, amax, sum_sq, numel, nonfinite: outlier_ratio(amax, sum_sq, numel, nonfinite),
    ),
    # the block metrics exist only for the steps that carried the block columns (the range, a stored
    # column, is "derived" as itself so that a step without it contributes nothing)
    BLOCK_AT_LIMIT_ID: (("blocks_at_limit", "blocks"), lambda _, n, blocks: block_fraction(n, blocks)),
    BLOCK_OVERFLOW_ID: (("blocks_overflow", "blocks"), lambda _, n, blocks: block_fraction(n, blocks)),
    BLOCK_UNDERFLOW_ID: (("blocks_underflow", "blocks"), lambda _, n, blocks: block_fraction(n, blocks)),
    STAT_IDS["block_range"]: (("block_range",), lambda _, block_range: np.asarray(block_range, np.float64)),
}


def _reduce(how: str):
    return {"max": np.maximum, "min": np.minimum, "sum": np.add}[how]


def combine(a: np.ndarray, b: np.ndarray, how: str) -> np.ndarray:
    """Merge two aggregates of the same metric (NaN-propagating)."""
    return _reduce(how)(a, b)


def reduce_groups(values: np.ndarray, starts: np.ndarray, how: str) -> np.ndarray:
    """Aggregate consecutive row groups of `values` (n, T) beginning at row indices `starts`."""
    return _reduce(how).reduceat(values, starts, axis=0)


def _metric_values(stats: dict[str, np.ndarray], fp8_max: np.ndarray) -> dict[int, tuple[np.ndarray, str]]:
    """Per-step values of every heatmap metric the columns in `stats` give: {rollup metric id: ((S, T), how)}
    (a derived metric only where all its columns are there: the quality metrics only for steps that carried
    them)."""
    metrics: dict[int, tuple[np.ndarray, str]] = {}
    for name, (metric, how) in HEATMAP_METRICS.items():
        if metric not in DERIVED:
            if name in stats:
                metrics[metric] = (np.asarray(stats[name], dtype=np.float64), how)
            continue
        columns, derive = DERIVED[metric]
        if all(c in stats for c in columns):
            metrics[metric] = (derive(fp8_max, *(stats[c] for c in columns)), how)
    return metrics


def update_rollups(
    session: Session,
    run_id: int,
    steps: np.ndarray,
    stats: dict[str, np.ndarray],
    fp8_max: np.ndarray,
    last_before: int | None,
    last_after: int,
) -> None:
    """Keep the rollups up to date after storing new steps (ascending, not stored before).

    A block is written once, when the run moves past it (**sealed**): block ``b`` of level ``L`` exists from
    the batch whose steps take the run's last step to ``(b + 1) * L`` or beyond, computed from what is stored
    beneath it (the steps' rows for level 8, the eight blocks of the level below otherwise). The block the
    run is in (``last_step // L``) has no row yet: readers take it from the finer levels (`cover`). A step
    that arrives late, into a block sealed already, is merged into it (read, merge, write). So a live run
    writes a level-8 row every 8 steps instead of rewriting one row per level and metric at every step.

    `last_before` / `last_after`: the run's last step before and after this batch. The caller holds the
    run's write lock, so neither the sealing nor a merge can race.
    """
    T = len(fp8_max)
    for level, late in late_steps(LEVELS, steps, last_before):
        sub = {name: m[late] for name, m in stats.items()}
        _merge_into_blocks(session, run_id, level, steps[late], _metric_values(sub, fp8_max), T)
    for level, first, last in sealed_blocks(LEVELS, steps, last_before, last_after):
        _seal(session, run_id, level, first, last, fp8_max)


def late_steps(
    levels: tuple[int, ...], steps: np.ndarray, last_before: int | None
) -> Iterator[tuple[int, np.ndarray]]:
    """``(level, mask)`` of the new ``steps`` (ascending) that arrive late at each level: into a block the
    run had sealed before this batch (its last step was ``last_before``). Stops at the first level where
    none is: a step not late at one level is not late at a coarser one."""
    if not len(steps) or last_before is None:
        return
    for level in levels:
        late = steps < last_before // level * level
        if not late.any():
            return
        yield level, late


def sealed_blocks(
    levels: tuple[int, ...], steps: np.ndarray, last_before: int | None, last_after: int
) -> Iterator[tuple[int, int, int]]:
    """``(level, first, last)``: the blocks of each level that this batch seals, those the run's last step
    moved past from ``last_before`` (a new run: from its first new step) to ``last_after``. Stops at the
    first level that seals none: a coarser one seals none either."""
    lowest = int(steps[0]) if len(steps) else last_after
    for level in levels:
        first = (lowest if last_before is None else last_before) // level
        last = last_after // level - 1
        if first > last:
            return
        yield level, first, last


def _merge_into_blocks(
    session: Session, run_id: int, level: int, steps: np.ndarray, metrics: dict, T: int
) -> None:
    """Fold steps into existing blocks of one level: read the touched blocks once, merge, write back."""
    blocks = steps // level
    starts = group_starts(blocks)
    block_ids = blocks[starts].tolist()
    counts = np.diff(np.r_[starts, len(steps)]).tolist()
    fresh = {metric: reduce_groups(values, starts, how) for metric, (values, how) in metrics.items()}
    existing = {
        (row.metric, row.block): row
        for row in session.execute(
            select(Rollup.metric, Rollup.block, Rollup.values, Rollup.n_steps).where(
                Rollup.run_id == run_id,
                Rollup.level == level,
                Rollup.block.between(block_ids[0], block_ids[-1]),
            )
        )
    }
    inserts, updates = [], []
    for metric, agg in fresh.items():
        how = metrics[metric][1]
        for j, block in enumerate(block_ids):
            old = existing.get((metric, block))
            row = {"run_id": run_id, "level": level, "metric": metric, "block": block}
            if old is None:
                row.update(values=pack(agg[j]), n_steps=counts[j])
                inserts.append(row)
            else:
                row.update(
                    values=pack(combine(unpack(old.values, T), agg[j], how)), n_steps=old.n_steps + counts[j]
                )
                updates.append(row)
    if inserts:
        session.execute(insert(Rollup), inserts)
    if updates:
        session.execute(update(Rollup), updates)


def _seal(session: Session, run_id: int, level: int, first: int, last: int, fp8_max: np.ndarray) -> None:
    """Write the blocks [first, last] of `level` from what lies beneath them (each block once; a row left by
    an older version of this code for a block then still open is replaced)."""
    T = len(fp8_max)
    lo, hi = first * level, (last + 1) * level - 1
    if level == LEVELS[0]:
        ids = sorted(set(STAT_IDS.values()))
        present, columns = read_step_stats_each(session, run_id, ids, lo, hi, T)
        if not present:
            return
        parts: dict[int, tuple[np.ndarray, np.ndarray, str]] = {}  # metric -> (steps, values, how)
        for name, (metric, how) in HEATMAP_METRICS.items():
            if metric not in DERIVED:
                if STAT_IDS[name] in columns:
                    parts[metric] = (present[STAT_IDS[name]], columns[STAT_IDS[name]], how)
                continue
            cols, derive = DERIVED[metric]
            need = [STAT_IDS[c] for c in cols]
            common, mats = on_common_steps(present, columns, need, T)
            if len(common):
                parts[metric] = (common, derive(fp8_max, *(mats[i] for i in need)), how)
        child_blocks = {
            metric: (steps // level, values, how) for metric, (steps, values, how) in parts.items()
        }
        # each metric counts the steps that gave it a value (the quality ones: those that carried them)
        weights = {metric: np.ones(len(steps), dtype=np.int64) for metric, (steps, _, _) in parts.items()}
    else:
        child = LEVELS[LEVELS.index(level) - 1]
        rows = session.execute(
            select(Rollup.metric, Rollup.block, Rollup.values, Rollup.n_steps)
            .where(
                Rollup.run_id == run_id,
                Rollup.level == child,
                Rollup.block.between(lo // child, hi // child),
            )
            .order_by(Rollup.metric, Rollup.block)
        ).all()
        if not rows:
            return
        by_metric: dict[int, list] = {}
        for r in rows:
            by_metric.setdefault(r.metric, []).append(r)
        how_of = {metric: how for metric, how in HEATMAP_METRICS.values()}
        child_blocks, weights = {}, {}
        for metric, rs in by_metric.items():
            if metric not in how_of:
                continue
            blocks = np.fromiter((r.block for r in rs), np.int64, len(rs)) * child // level
            child_blocks[metric] = (blocks, unpack_rows([r.values for r in rs], T), how_of[metric])
            weights[metric] = np.fromiter((r.n_steps for r in rs), np.int64, len(rs))
    inserts = []
    for metric, (blocks, values, how) in child_blocks.items():
        starts = group_starts(blocks)
        agg = reduce_groups(values, starts, how)
        ns = np.add.reduceat(weights[metric], starts)
        for j, block in enumerate(blocks[starts].tolist()):
            inserts.append(
                {
                    "run_id": run_id,
                    "level": level,
                    "metric": metric,
                    "block": block,
                    "values": pack(agg[j]),
                    "n_steps": int(ns[j]),
                }
            )
    if inserts:
        session.execute(
            delete(Rollup).where(
                Rollup.run_id == run_id, Rollup.level == level, Rollup.block.between(first, last)
            )
        )
        session.execute(insert(Rollup), inserts)


@dataclass
class HeatmapPlan:
    """Bucket layout of a heatmap: `width` steps per bucket, aligned to its multiples, read at `level`."""

    width: int
    level: int
    first_bucket: int
    n_buckets: int

    def tail(self, after_step: int, last_step: int) -> HeatmapPlan:
        """The buckets of this layout (over steps up to `last_step`) that hold a step after `after_step`:
        what a client holding the buckets up to that step lacks, in the same layout."""
        end = self.first_bucket + self.n_buckets
        first = end if after_step >= last_step else max(self.first_bucket, (after_step + 1) // self.width)
        return HeatmapPlan(self.width, self.level, first, max(0, end - first))


def heatmap_plan(session: Session, run_id: int, lo: int, hi: int, max_cols: int) -> HeatmapPlan:
    """The bucket layout `read_heatmap` chooses for steps [lo, hi] of the run (no finer than the compacted
    blocks where the range reaches below the steps kept per step)."""
    return plan_heatmap(lo, hi, max_cols, heatmap_min_width(lo, raw_kept_from(session, run_id)))


def plan_heatmap(lo: int, hi: int, max_cols: int, min_width: int = 1) -> HeatmapPlan:
    """Choose the bucket width for steps [lo, hi] and at most `max_cols` columns.

    The width is ceil(span / max_cols) (at least `min_width`) rounded up to a multiple of the largest rollup
    level not above it, so every bucket is made of whole rollup blocks (plus raw steps at the range's ends).
    """
    span = hi - lo + 1
    want = max(min_width, math.ceil(span / max_cols))
    level = max([lv for lv in LEVELS if lv <= want], default=1)
    width = math.ceil(want / level) * level
    while hi // width - lo // width + 1 > max_cols:
        width += level
    return HeatmapPlan(
        width=width, level=level, first_bucket=lo // width, n_buckets=hi // width - lo // width + 1
    )


def cover(lo: int, hi: int, levels: list[int], last_step: int | None = None) -> list[tuple[int, int, int]]:
    """Split steps [lo, hi] into (level, first_block, last_block) pieces, coarsest first; level 1 = raw.

    With the run's `last_step`, a level's block that holds it (not sealed yet: `update_rollups`) is left to
    the finer levels."""
    if lo > hi:
        return []
    if not levels:
        return [(1, lo, hi)]
    level, rest = levels[0], levels[1:]
    first = -(-lo // level)
    last = (hi + 1) // level - 1
    if last_step is not None:
        last = min(last, last_step // level - 1)
    if first > last:
        return cover(lo, hi, rest, last_step)
    return [
        (level, first, last),
        *cover(lo, first * level - 1, rest, last_step),
        *cover((last + 1) * level, hi, rest, last_step),
    ]


def read_heatmap(
    session: Session,
    run_id: int,
    metric: str,
    lo: int,
    hi: int,
    max_cols: int,
    fp8_max: np.ndarray,
    *,
    plan: HeatmapPlan | None = None,
) -> dict:
    """Aggregate `metric` over steps [lo, hi] into at most `max_cols` aligned buckets (or the buckets of
    `plan`, a layout of `heatmap_plan` for the same range or its `tail`: then only their steps are read).

    Returns a dict with `width`, `starts`/`ends` (first and last step of each bucket, clipped to the range),
    `steps` (number of stored steps per bucket), `values` (T, C) float64 (NaN in empty buckets) and
    `empty` (C,) bool. Memory: the (T, C) answer plus the stored rows read; the caller bounds T x C
    (`heatmap_cells`) before calling.
    """
    metric_id, how = HEATMAP_METRICS[metric]
    kept_from = raw_kept_from(session, run_id)
    last_step = session.scalar(select(Run.last_step).where(Run.id == run_id))
    if plan is None:
        plan = plan_heatmap(lo, hi, max_cols, heatmap_min_width(lo, kept_from))
    lo = max(lo, plan.first_bucket * plan.width)  # a tail reads its own buckets' steps only
    T = len(fp8_max)
    starts_list: list[np.ndarray] = []
    values_list: list[np.ndarray] = []
    weights_list: list[np.ndarray] = []
    usable = [lv for lv in reversed(LEVELS) if lv <= plan.level]
    for level, first, last in _compacted_to_blocks(cover(lo, hi, usable, last_step), kept_from):
        if level == 1:
            steps, matrix = _read_raw(session, run_id, metric_id, first, last, fp8_max)
            if len(steps):
                starts_list.append(steps)
                values_list.append(matrix)
                weights_list.append(np.ones(len(steps), dtype=np.int64))
            continue
        rows = session.execute(
            select(Rollup.block, Rollup.values, Rollup.n_steps)
            .where(
                Rollup.run_id == run_id,
                Rollup.level == level,
                Rollup.metric == metric_id,
                Rollup.block.between(first, last),
            )
            .order_by(Rollup.block)
        ).all()
        if rows:
            starts_list.append(np.fromiter((r.block for r in rows), np.int64, len(rows)) * level)
            values_list.append(unpack_rows([r.values for r in rows], T))
            weights_list.append(np.fromiter((r.n_steps for r in rows), np.int64, len(rows)))
    n = plan.n_buckets
    # the answer itself, tensor-major as it is sent; an empty bucket is never computed, only left NaN
    values = np.full((T, n), np.nan)
    counts = np.zeros(n, dtype=np.int64)
    if starts_list:
        starts = np.concatenate(starts_list)
        order = np.argsort(starts, kind="stable")
        starts = starts[order]
        stored = np.concatenate(values_list)[order]
        weights = np.concatenate(weights_list)[order]
        buckets = starts // plan.width - plan.first_bucket
        group = group_starts(buckets)
        cols = buckets[group]
        values[:, cols] = reduce_groups(stored, group, how).T
        counts[cols] = np.add.reduceat(weights, group)
    bucket_ids = np.arange(plan.first_bucket, plan.first_bucket + n)
    return {
        "width": plan.width,
        "starts": np.maximum(bucket_ids * plan.width, lo),
        "ends": np.minimum((bucket_ids + 1) * plan.width - 1, hi),
        "steps": counts,
        "values": values,
        "empty": counts == 0,
    }


def raw_kept_from(session: Session, run_id: int) -> int:
    """The first step whose statistics are still kept per step: below it, compaction (`retention.py`) left
    only the rollups. A multiple of `COMPACT_BLOCK`; 0 when nothing was compacted."""
    amax = STAT_IDS["amax"]  # stored for every step that carried statistics
    first = session.scalar(
        select(func.min(StepStat.step)).where(StepStat.run_id == run_id, StepStat.metric == amax)
    )
    blocks = (Rollup.run_id == run_id, Rollup.level == COMPACT_BLOCK, Rollup.metric == amax)
    if first is None:  # no step kept: all compacted (the blocks after the last rollup are not)
        last = session.scalar(select(func.max(Rollup.block)).where(*blocks))
        return 0 if last is None else (int(last) + 1) * COMPACT_BLOCK
    aligned = int(first) // COMPACT_BLOCK * COMPACT_BLOCK
    older = session.scalar(
        select(Rollup.block).where(*blocks, Rollup.block < aligned // COMPACT_BLOCK).limit(1)
    )
    return 0 if older is None else aligned


def heatmap_min_width(lo: int, kept_from: int) -> int:
    """A range that reaches below the steps kept per step is drawn at no finer than the compacted blocks."""
    return COMPACT_BLOCK if lo < kept_from else 1


def _compacted_to_blocks(pieces: list[tuple[int, int, int]], kept_from: int) -> list[tuple[int, int, int]]:
    """The raw pieces of a `cover` below `kept_from` read from the smallest rollup blocks instead (the
    steps' own rows are gone); a range's edge there is read at the block's resolution."""
    if kept_from <= 0:
        return pieces
    out = []
    for level, first, last in pieces:
        if level != 1 or first >= kept_from:
            out.append((level, first, last))
            continue
        top = min(last, kept_from - 1)
        out.append((COMPACT_BLOCK, first // COMPACT_BLOCK, top // COMPACT_BLOCK))
        if last >= kept_from:
            out.append((1, kept_from, last))
    return out


def _read_raw(
    session: Session, run_id: int, metric_id: int, lo: int, hi: int, fp8_max: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-step values of one heatmap metric for steps [lo, hi] (a derived one computed from its columns, for
    the steps that stored all of them)."""
    T = len(fp8_max)
    if metric_id not in DERIVED:
        steps, matrices = read_step_stats(session, run_id, [metric_id], lo, hi, T)
        return steps, matrices[metric_id]
    columns, derive = DERIVED[metric_id]
    ids = [STAT_IDS[c] for c in columns]
    steps, m = read_step_stats(session, run_id, ids, lo, hi, T)
    return steps, derive(fp8_max, *(m[i] for i in ids))
