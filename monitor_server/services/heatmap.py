"""The heatmap answer both heatmap routes share (`GET /runs/{id}/heatmap` as JSON and
`GET /runs/{id}/heatmap/packed` as float64): the run's stored steps clipped to the request, the cell limit,
and the buckets read from the rollups (`monitor_server.storage.rollups`).

One answer can carry several metrics of the same buckets and only some tensors' rows, so that a view asks
once for what it draws: the run page's heatmap its metric and the non-finite counts that mark cells, a
tooltip the other metrics of one layer, a drill-down six metrics of one layer, a live refresh only the
buckets after those it holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from monitor_server.storage.models import Run
from monitor_server.storage.query_schemas import HeatmapHead
from monitor_server.storage.rollups import HEATMAP_METRICS, heatmap_plan, read_heatmap
from monitor_server.storage.run_meta import RunMeta
from monitor_server.storage.series import step_range


class HeatmapTooLarge(ValueError):
    """The heatmap asked for has more cells than `max_heatmap_cells`; the message says what to ask for."""


class HeatmapBadParameter(ValueError):
    """A heatmap query parameter that names no metric, tensor or layer of the run; the message starts
    with the parameter's name."""


@dataclass(frozen=True)
class HeatmapSelection:
    """What one heatmap answer holds: `metrics` (each once, in the order asked), the rows' tensor indices
    (ascending), and, for a live refresh, the step after which the caller lacks buckets and the bucket
    width it holds (a layout of another width is sent whole)."""

    metrics: tuple[str, ...]
    rows: tuple[int, ...]
    after_step: int | None = None
    held_width: int | None = None


def heatmap_selection(
    meta: RunMeta,
    *,
    metric: str | None,
    metrics: str | None,
    tensors: str | None,
    layer: str | None,
    after_step: int | None = None,
    held_width: int | None = None,
) -> HeatmapSelection:
    """The selection of the query parameters `metric` (one), `metrics` (comma-separated), `tensors`
    (comma-separated indices and ranges `a-b`) and `layer` (a layer's tensors); amax and every tensor when
    none is given.

    Raises:
        HeatmapBadParameter: an unknown metric, tensor or layer, an empty item, or two parameters that
            exclude each other (metric and metrics; tensors and layer).
    """
    if metric is not None and metrics is not None:
        raise HeatmapBadParameter("metrics: give metric or metrics, not both")
    names = [metric or "amax"] if metrics is None else [m.strip() for m in metrics.split(",")]
    for name in names:
        if name not in HEATMAP_METRICS:
            raise HeatmapBadParameter(
                f"metrics: {name!r} is not a heatmap metric (one of {', '.join(HEATMAP_METRICS)})"
            )
    if tensors is not None and layer is not None:
        raise HeatmapBadParameter("tensors: give tensors or layer, not both")
    T = meta.num_tensors
    if tensors is not None:
        rows = _tensor_rows(tensors, T)
    elif layer is not None:
        rows = tuple(t.index for t in meta.tensors if t.layer == layer)
        if not rows:
            raise HeatmapBadParameter(f"layer: run {meta.run_id} has no layer {layer!r}")
    else:
        rows = tuple(range(T))
    return HeatmapSelection(tuple(dict.fromkeys(names)), rows, after_step, held_width)


def _is_index(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _tensor_rows(text: str, num_tensors: int) -> tuple[int, ...]:
    """The tensor indices of a `tensors` parameter ("3,4,5", "0-95,200"), ascending, each once."""
    rows: set[int] = set()
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        if not _is_index(first) or (dash and not _is_index(last)):
            raise HeatmapBadParameter(f"tensors: {item!r} is not a tensor index or a range a-b")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi >= num_tensors or lo > hi:
            raise HeatmapBadParameter(
                f"tensors: {item!r} is not within the run's tensors 0-{num_tensors - 1}"
            )
        rows.update(range(lo, hi + 1))
    return tuple(sorted(rows))


def heatmap_buckets(
    session: Session,
    run: Run,
    meta: RunMeta,
    selection: HeatmapSelection,
    *,
    lo: int | None,
    hi: int | None,
    max_cols: int,
    max_cells: int,
) -> tuple[HeatmapHead, dict[str, Any] | None]:
    """The answer's fields other than the values, and its matrix: `values` (metrics x rows, C) float64,
    metric-major (row m * R + r is metric m of the r-th selected tensor), `empty` (metrics, C) bool per
    metric's buckets. None instead of the matrix when the clipped step range is empty (then the bucket
    fields are empty).

    Raises:
        HeatmapTooLarge: rows x columns above `max_cells`.
    """
    rng = step_range(run.first_step, run.last_step, lo, hi)
    tensors = [asdict(meta.tensors[i]) for i in selection.rows]
    head: dict[str, Any] = {
        "metric": selection.metrics[0],
        "metrics": list(selection.metrics),
        "aggregation": HEATMAP_METRICS[selection.metrics[0]][1],
        "aggregations": [HEATMAP_METRICS[m][1] for m in selection.metrics],
        "tensors": tensors,
    }
    if rng is None:
        empty: dict[str, Any] = {"bucket_start": [], "bucket_end": [], "bucket_steps": [], "after_step": None}
        return HeatmapHead(
            **head, **empty, bucket_width=1, metric_steps=[[] for _ in selection.metrics]
        ), None
    plan = heatmap_plan(session, run.id, rng[0], rng[1], max_cols)
    after = selection.after_step
    if after is not None and selection.held_width not in (None, plan.width):
        after = None  # the caller's buckets are of another width now: it gets the whole range
    if after is not None:
        plan = plan.tail(after, rng[1])
    rows = len(selection.metrics) * len(selection.rows)
    if rows * plan.n_buckets > max_cells:
        raise HeatmapTooLarge(
            f"a heatmap of {rows} rows ({len(selection.metrics)} metrics x {len(selection.rows)} tensors) x "
            f"{plan.n_buckets} columns exceeds the limit of {max_cells} cells (max_heatmap_cells); ask for "
            f"at most {max(1, max_cells // rows)} columns (max_cols), a narrower step range, fewer metrics "
            "or fewer tensors"
        )
    parts = [
        read_heatmap(session, run.id, m, rng[0], rng[1], max_cols, meta.fp8_max, plan=plan)
        for m in selection.metrics
    ]
    picked = np.asarray(selection.rows, dtype=np.intp)
    values = np.concatenate([p["values"][picked] for p in parts]) if parts else np.zeros((0, 0))
    first = parts[0]
    buckets = HeatmapHead(
        **head,
        bucket_width=first["width"],
        bucket_start=first["starts"].tolist(),
        bucket_end=first["ends"].tolist(),
        bucket_steps=first["steps"].tolist(),
        metric_steps=[p["steps"].tolist() for p in parts],
        after_step=after,
    )
    return buckets, {"values": values, "empty": np.stack([p["empty"] for p in parts])}
