"""The heatmap answer both heatmap routes share (`GET /runs/{id}/heatmap` as JSON and
`GET /runs/{id}/heatmap/packed` as float64): the run's stored steps clipped to the request, the cell limit,
and the buckets read from the rollups (`monitor_server.rollups`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from sqlalchemy.orm import Session

from monitor_server.models import Run
from monitor_server.rollups import HEATMAP_METRICS, plan_heatmap, read_heatmap
from monitor_server.run_meta import RunMeta
from monitor_server.schemas import HeatmapHead, HeatmapMetric
from monitor_server.series import step_range


class HeatmapTooLarge(ValueError):
    """The heatmap asked for has more cells than `max_heatmap_cells`; the message says what to ask for."""


def heatmap_buckets(
    session: Session,
    run: Run,
    meta: RunMeta,
    metric: HeatmapMetric,
    lo: int | None,
    hi: int | None,
    max_cols: int,
    max_cells: int,
) -> tuple[HeatmapHead, dict[str, Any] | None]:
    """The answer's fields other than the values and the buckets of `read_heatmap`, None when the clipped
    step range is empty (then the bucket fields are empty).

    Raises:
        HeatmapTooLarge: tensors x columns above `max_cells`.
    """
    rng = step_range(run.first_step, run.last_step, lo, hi)
    head: dict[str, Any] = {
        "metric": metric,
        "aggregation": HEATMAP_METRICS[metric][1],
        "tensors": [asdict(t) for t in meta.tensors],
    }
    if rng is None:
        return HeatmapHead(**head, bucket_width=1, bucket_start=[], bucket_end=[], bucket_steps=[]), None
    n_cols = plan_heatmap(rng[0], rng[1], max_cols).n_buckets
    if n_cols * meta.num_tensors > max_cells:
        raise HeatmapTooLarge(
            f"a heatmap of {meta.num_tensors} tensors x {n_cols} columns exceeds the limit of {max_cells} "
            f"cells (max_heatmap_cells); ask for at most {max(1, max_cells // meta.num_tensors)} columns "
            "(max_cols) or a narrower step range"
        )
    hm = read_heatmap(session, run.id, metric, rng[0], rng[1], max_cols, meta.fp8_max)
    buckets = HeatmapHead(
        **head,
        bucket_width=hm["width"],
        bucket_start=hm["starts"].tolist(),
        bucket_end=hm["ends"].tolist(),
        bucket_steps=hm["steps"].tolist(),
    )
    return buckets, hm
