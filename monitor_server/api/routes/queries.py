"""Read paths for the dashboard: tensors, scalar series, heatmaps, client events and per-layer health."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, HTTPException, Query, Response, status
from sqlalchemy import case, null, select

from monitor_server.alerting import alert_public
from monitor_server.api.deps import CtxDep, EventId, ReadDep, RunId, SessionDep
from monitor_server.api.routes.runs import get_run_or_404
from monitor_server.models import Alert, EventRow, as_utc
from monitor_server.rollups import HEATMAP_METRICS, plan_heatmap, read_heatmap
from monitor_server.run_meta import RunMeta
from monitor_server.schemas import (
    EventKind,
    EventPublic,
    HeatmapPublic,
    LayerHealth,
    SeriesPublic,
    TensorSpec,
)
from monitor_server.series import downsample_minmax, read_series
from monitor_server.wire import iso_dates, jsonable, matrix_json

router = APIRouter(prefix="/runs", tags=["queries"])

FromQ = Annotated[
    int | None, Query(alias="from", ge=0, le=2**62, description="first step (default: the run's first)")
]
ToQ = Annotated[
    int | None, Query(alias="to", ge=0, le=2**62, description="last step (default: the run's last)")
]


def _meta(ctx: CtxDep, session: SessionDep, run_id: int) -> RunMeta:
    get_run_or_404(session, run_id)
    meta = ctx.run_meta.get(session, run_id)
    if meta is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} has no tensors")
    return meta


def check_order(lo: int | None, hi: int | None) -> None:
    """422 when the requested `to` step comes before `from`."""
    if lo is not None and hi is not None and hi < lo:
        raise HTTPException(422, f"to ({hi}) is before from ({lo})")


def step_range(first: int | None, last: int | None, lo: int | None, hi: int | None) -> tuple[int, int] | None:
    """The requested step range clipped to the stored one; None when nothing is stored or it is empty."""
    check_order(lo, hi)
    if first is None or last is None:
        return None
    lo = first if lo is None else max(lo, first)
    hi = last if hi is None else min(hi, last)
    return (lo, hi) if lo <= hi else None


def heatmap_buckets(
    ctx: CtxDep, session: SessionDep, run_id: int, metric: str, lo: int | None, hi: int | None, max_cols: int
) -> tuple[RunMeta, dict[str, Any], dict[str, Any] | None]:
    """What the JSON and the packed heatmap share: the run's meta, the answer's fields other than the values
    (`metric, aggregation, tensors, bucket_width, bucket_start, bucket_end, bucket_steps`) and the buckets
    of `read_heatmap`, None when the clipped step range is empty (then the bucket fields are empty)."""
    meta = _meta(ctx, session, run_id)
    run = get_run_or_404(session, run_id)
    rng = step_range(run.first_step, run.last_step, lo, hi)
    head: dict[str, Any] = {
        "metric": metric,
        "aggregation": HEATMAP_METRICS[metric][1],
        "tensors": [asdict(t) for t in meta.tensors],
    }
    if rng is None:
        head.update(bucket_width=1, bucket_start=[], bucket_end=[], bucket_steps=[])
        return meta, head, None
    n_cols = plan_heatmap(rng[0], rng[1], max_cols).n_buckets
    limit = ctx.settings.max_heatmap_cells
    if n_cols * meta.num_tensors > limit:
        raise HTTPException(
            422,
            f"a heatmap of {meta.num_tensors} tensors x {n_cols} columns exceeds the limit of {limit} cells "
            f"(max_heatmap_cells); ask for at most {max(1, limit // meta.num_tensors)} columns (max_cols) "
            "or a narrower step range",
        )
    hm = read_heatmap(session, run_id, metric, rng[0], rng[1], max_cols, meta.fp8_max)
    head.update(
        bucket_width=hm["width"],
        bucket_start=hm["starts"].tolist(),
        bucket_end=hm["ends"].tolist(),
        bucket_steps=hm["steps"].tolist(),
    )
    return meta, head, hm


@router.get("/{run_id}/tensors", response_model=list[TensorSpec])
def list_tensors(
    run_id: RunId, ctx: CtxDep, session: SessionDep, _principal: ReadDep
) -> list[dict[str, Any]]:
    """The run's quantized tensors, by index."""
    return [asdict(t) for t in _meta(ctx, session, run_id).tensors]


@router.get("/{run_id}/series", response_model=SeriesPublic)
def get_series(
    run_id: RunId,
    session: SessionDep,
    _principal: ReadDep,
    name: Annotated[
        str, Query(min_length=1, max_length=200, description="scalar name, e.g. loss, lr, grad_norm")
    ],
    from_: FromQ = None,
    to: ToQ = None,
    max_points: Annotated[int, Query(ge=2, le=100_000)] = 2000,
) -> Response:
    """A scalar over steps, downsampled to at most `max_points` keeping each bucket's min and max point."""
    run = get_run_or_404(session, run_id)
    rng = step_range(run.first_step, run.last_step, from_, to)
    out: dict[str, Any] = {"name": name, "from": None, "to": None, "bucket_width": 1, "downsampled": False}
    if rng is None:
        out.update(steps=[], values=[])
    else:
        steps, values = read_series(session, run_id, name, *rng)
        kept_steps, kept_values, width = downsample_minmax(steps, values, max_points)
        out.update(
            {
                "from": rng[0],
                "to": rng[1],
                "bucket_width": width,
                "downsampled": len(kept_steps) < len(steps),
            },
            steps=kept_steps.tolist(),
            values=jsonable(kept_values.tolist()),
        )
    return Response(orjson.dumps(out), media_type="application/json")


@router.get("/{run_id}/heatmap", response_model=HeatmapPublic)
def get_heatmap(
    run_id: RunId,
    ctx: CtxDep,
    session: SessionDep,
    _principal: ReadDep,
    metric: Literal["amax", "scale", "overflow", "underflow", "nonfinite", "headroom"] = "amax",
    from_: FromQ = None,
    to: ToQ = None,
    max_cols: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Response:
    """Tensors x step-buckets matrix of one metric; buckets keep the max (amax, scale), the min (headroom)
    or the sum (counts), so no spike is averaged away. Bucket width is a multiple of a rollup block,
    so there are at most `max_cols` columns.
    """
    meta, head, hm = heatmap_buckets(ctx, session, run_id, metric, from_, to, max_cols)
    if hm is None:
        return Response(
            orjson.dumps({**head, "values": [[] for _ in meta.tensors]}), media_type="application/json"
        )
    # splice the pre-rendered matrix into the JSON object (avoids building 10^5..10^6 Python floats)
    head_json = orjson.dumps(head)
    body = head_json[:-1] + b',"values":' + matrix_json(hm["values"], hm["empty"]) + b"}"
    return Response(body, media_type="application/json")


#: event details up to this size (as JSON) travel whole in lists and on the stream; larger ones as their
#: summary, the whole details from `GET /runs/{id}/events/{event_id}`
INLINE_DETAIL_BYTES = 4096


def event_light(event: dict[str, Any]) -> dict[str, Any]:
    """The light form of an event (as lists and the stream carry it): `details` whole when small, else
    its summary, with `details_bytes` and `details_complete` saying which."""
    size = event.get("details_bytes") or 0
    complete = size <= INLINE_DETAIL_BYTES and event.get("details") is not None
    details = event["details"] if complete else (event.get("summary") or {})
    out = {k: v for k, v in event.items() if k not in ("details", "summary")}
    return {**out, "details": details, "details_bytes": size, "details_complete": complete}


@router.get("/{run_id}/events", response_model=list[EventPublic])
def list_events(
    run_id: RunId,
    session: SessionDep,
    _principal: ReadDep,
    kind: EventKind | None = None,
    from_: FromQ = None,
    to: ToQ = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Response:
    """Client-reported events in step order, optionally of one kind and within a step range; at most
    `limit`, the earliest first. Light records: `details` is whole up to 4 KiB of JSON, else its summary
    (the top-level numbers and texts) with `details_complete` false; the whole event, flight recorder
    included, is `GET /runs/{id}/events/{event_id}`."""
    get_run_or_404(session, run_id)
    check_order(from_, to)
    small = EventRow.details_bytes <= INLINE_DETAIL_BYTES
    query = select(
        EventRow.id,
        EventRow.run_id,
        EventRow.kind,
        EventRow.step,
        EventRow.created_at,
        EventRow.details_bytes,
        EventRow.summary,
        # only small details leave the database: a list of big events costs their summaries
        case((small, EventRow.details), else_=null()).label("details"),
    ).where(EventRow.run_id == run_id)
    if kind is not None:
        query = query.where(EventRow.kind == kind)
    if from_ is not None:
        query = query.where(EventRow.step >= from_)
    if to is not None:
        query = query.where(EventRow.step <= to)
    rows = session.execute(query.order_by(EventRow.step, EventRow.id).limit(limit)).mappings()
    out = [event_light(iso_dates({**row, "created_at": as_utc(row["created_at"])})) for row in rows]
    return Response(orjson.dumps(out), media_type="application/json")


@router.get("/{run_id}/events/{event_id}", response_model=EventPublic)
def get_event(run_id: RunId, event_id: EventId, session: SessionDep, _principal: ReadDep) -> Response:
    """One event whole: its details as the client sent them (a flight recorder, histograms)."""
    event = session.get(EventRow, event_id)
    if event is None or event.run_id != run_id:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"event {event_id} of run {run_id} not found")
    return Response(orjson.dumps(event_public(event)), media_type="application/json")


def event_public(event: EventRow) -> dict[str, Any]:
    """An event whole, as `GET /runs/{id}/events/{event_id}` returns it."""
    return iso_dates(
        {
            "id": event.id,
            "run_id": event.run_id,
            "kind": event.kind,
            "step": event.step,
            "details": event.details,
            "details_bytes": event.details_bytes or 0,
            "details_complete": True,
            "created_at": as_utc(event.created_at),
        }
    )


@router.get("/{run_id}/layers", response_model=list[LayerHealth])
def get_layers(run_id: RunId, ctx: CtxDep, session: SessionDep, _principal: ReadDep) -> Response:
    """Per-layer health ranked by severity, with the reasons a layer is flagged (detector engine)."""
    meta = _meta(ctx, session, run_id)
    alerts = session.execute(
        select(Alert).where(Alert.run_id == run_id, Alert.state == "open").order_by(Alert.id)
    ).scalars()
    open_alerts = [jsonable(iso_dates(alert_public(a, meta))) for a in alerts]
    ranked = ctx.detection.layer_health(session, run_id, open_alerts)
    if ranked is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
    return Response(orjson.dumps(ranked), media_type="application/json")
