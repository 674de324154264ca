"""Read paths for the dashboard: tensors, scalar series, heatmaps, client events and per-layer health."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response, status

from fp8_protocol.codec import jsonable
from monitor_server.api.deps import (
    CtxDep,
    EventId,
    FromQ,
    HeatmapDep,
    ReadDep,
    ReadRunDep,
    RunId,
    RunMetaDep,
    SessionDep,
    ToQ,
    check_order,
    clipped_range,
)
from monitor_server.api.responses import json_response, model_json
from monitor_server.infra.wire import iso_dates, matrix_json
from monitor_server.services.alert_records import alert_public
from monitor_server.services.alerts import open_alerts
from monitor_server.services.client_events import event_of_run, event_public, run_events
from monitor_server.storage.block_hist import add_block_health, latest_block_stats
from monitor_server.storage.query_schemas import HeatmapPublic, LayerHealth, SeriesPublic
from monitor_server.storage.schemas import EventKind, EventPublic, TensorSpec
from monitor_server.storage.series import read_series, series_points

router = APIRouter(prefix="/runs", tags=["queries"])


@router.get("/{run_id}/tensors", response_model=list[TensorSpec])
def list_tensors(run_id: RunId, meta: RunMetaDep, _principal: ReadDep) -> list[TensorSpec]:
    """The run's quantized tensors, by index."""
    return [TensorSpec.model_validate(t, from_attributes=True) for t in meta.tensors]


@router.get("/{run_id}/series", response_model=SeriesPublic)
def get_series(
    run_id: RunId,
    run: ReadRunDep,
    session: SessionDep,
    name: Annotated[
        str, Query(min_length=1, max_length=200, description="scalar name, e.g. loss, lr, grad_norm")
    ],
    from_: FromQ = None,
    to: ToQ = None,
    max_points: Annotated[int, Query(ge=2, le=100_000)] = 2000,
) -> Response:
    """A scalar over steps, downsampled to at most `max_points` keeping each bucket's min and max point."""
    rng = clipped_range(run, from_, to)
    steps, values = read_series(session, run_id, [name], rng)[name]
    lo, hi = rng or (None, None)
    series = series_points(steps, values, max_points, SeriesPublic, name=name, from_step=lo, to_step=hi)
    return json_response(series)


@router.get("/{run_id}/heatmap", response_model=HeatmapPublic)
def get_heatmap(run_id: RunId, heatmap: HeatmapDep) -> Response:
    """Tensors x step-buckets matrix of one metric, or of several (`metrics`: a block of rows each) and
    of some tensors (`tensors` or `layer`); buckets keep the max (amax, scale, subnormal fraction, dynamic
    range, outlier ratio), the min (headroom, SQNR) or the sum (counts), so no spike is averaged away.
    Bucket width is a multiple of a rollup block, so there are at most `max_cols` columns; with
    `after_step`, only the buckets that hold later steps (a live view's refresh).
    """
    head, hm = heatmap
    if hm is None:
        rows = len(head.metrics) * len(head.tensors)
        return json_response(HeatmapPublic(**dict(head), values=[[] for _ in range(rows)]))
    # The fields but the values are validated by `HeatmapHead`; the matrix is spliced in as matrix_json
    # renders it (numbers, "NaN"/"Infinity"/"-Infinity", null), not through `HeatmapPublic`: for 512
    # tensors x 2000 buckets the whole model takes about 5x as long (bench/responses.py: ~215 ms against
    # ~43 ms), while tests/server/test_response_models.py checks the spliced answer against `HeatmapPublic`.
    R = len(head.tensors)
    blocks = [
        matrix_json(hm["values"][m * R : (m + 1) * R], empty)[1:-1] for m, empty in enumerate(hm["empty"])
    ]
    values = b"[" + b",".join(b for b in blocks if b) + b"]"
    body = model_json(head)[:-1] + b',"values":' + values + b"}"
    return Response(body, media_type="application/json")


@router.get("/{run_id}/events", response_model=list[EventPublic])
def list_events(
    run_id: RunId,
    _run: ReadRunDep,
    session: SessionDep,
    kind: EventKind | None = None,
    from_: FromQ = None,
    to: ToQ = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Response:
    """Client-reported events in step order, optionally of one kind and within a step range; at most
    `limit`, the earliest first. Light records: `details` is whole up to 4 KiB of JSON, else its summary
    (the top-level numbers and texts) with `details_complete` false; the whole event, flight recorder
    included, is `GET /runs/{id}/events/{event_id}`."""
    check_order(from_, to)
    found = run_events(session, run_id=run_id, kind=kind, lo=from_, hi=to, limit=limit)
    events = [EventPublic.model_validate(event) for event in found]
    return json_response(events)


@router.get("/{run_id}/events/{event_id}", response_model=EventPublic)
def get_event(run_id: RunId, event_id: EventId, session: SessionDep, _principal: ReadDep) -> Response:
    """One event whole: its details as the client sent them (a flight recorder, histograms)."""
    event = event_of_run(session, run_id=run_id, event_id=event_id)
    if event is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"event {event_id} of run {run_id} not found")
    return json_response(event_public(event))


@router.get("/{run_id}/layers", response_model=list[LayerHealth])
def get_layers(
    run_id: RunId, meta: RunMetaDep, ctx: CtxDep, session: SessionDep, _principal: ReadDep
) -> Response:
    """Per-layer health ranked by severity, with the reasons a layer is flagged (detector engine); for a run
    that sends block statistics, each tensor's and layer's latest block range and share of blocks at a scale
    limit (the layer's: the worst of its tensors)."""
    alerts = [jsonable(iso_dates(alert_public(a, meta))) for a in open_alerts(session, run_id=run_id)]
    ranked = ctx.detection.layer_health(session, run_id, alerts)
    if ranked is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")
    add_block_health(ranked, latest_block_stats(session, run_id, meta.num_tensors))
    return json_response([LayerHealth(**layer) for layer in ranked])
