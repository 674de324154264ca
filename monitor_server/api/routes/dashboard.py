"""Read paths the web dashboard needs beyond the run routes: who am I, one stream for all runs, several
scalar series from one pass over the steps, and the heatmap as packed float64 (a 512-tensor heatmap is
~8 MB of JSON to parse, ~3.4 MB of binary not to)."""

from __future__ import annotations

import struct
from typing import Annotated, Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, HTTPException, Query, Response
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials

from monitor_server.api.deps import (
    CtxDep,
    FromQ,
    ReadDep,
    RunDep,
    RunId,
    RunMetaDep,
    SessionDep,
    ToQ,
    authenticate,
    bearer_scheme,
    check_order,
)
from monitor_server.core.config import SCOPES
from monitor_server.events import ALL_RUNS, stream_events
from monitor_server.heatmap import HeatmapTooLarge, heatmap_buckets
from monitor_server.schemas import HeatmapMetric
from monitor_server.series import downsample_minmax, read_series, step_range
from monitor_server.wire import jsonable

router = APIRouter(tags=["dashboard"])


@router.get("/whoami")
def whoami(
    ctx: CtxDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
) -> dict[str, Any]:
    """The caller's token name and scopes (401 when tokens are configured and none or an unknown one is
    given). `auth` is false when the server runs without tokens: then everyone holds every scope."""
    principal = authenticate(ctx, credentials)
    return {
        "name": principal.name,
        "scopes": [s for s in SCOPES if s in principal.scopes],
        "auth": ctx.settings.auth_enabled,
    }


@router.get(
    "/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
)
async def stream_all(ctx: CtxDep, _principal: ReadDep) -> StreamingResponse:
    """Live events of all runs for the runs list: `step`, `alert` and `run` (each with `run_id`); a newly
    registered run is announced at once as a `run` event with `"created": true`."""
    sub = ctx.broker.subscribe(ALL_RUNS)
    return StreamingResponse(
        stream_events(sub, ctx.settings.sse_keepalive_seconds),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get(
    "/runs/{run_id}/heatmap/packed",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "header + float64 matrix"}},
)
def get_heatmap_packed(
    run_id: RunId,
    run: RunDep,
    meta: RunMetaDep,
    ctx: CtxDep,
    session: SessionDep,
    _principal: ReadDep,
    metric: HeatmapMetric = "amax",
    from_: FromQ = None,
    to: ToQ = None,
    max_cols: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Response:
    """`GET /runs/{id}/heatmap` (same parameters, buckets and aggregation) in a binary layout: a
    little-endian uint32 N, N bytes of JSON (the JSON answer's fields without `values`, plus `rows`, `cols`,
    `dtype`: "float64"), zero bytes up to a multiple of 8, then rows x cols little-endian float64 in row
    (tensor) order. NaN and infinities are native; cells of empty buckets (`bucket_steps` 0) are NaN."""
    check_order(from_, to)
    try:
        head, hm = heatmap_buckets(
            session, run, meta, metric, from_, to, max_cols, ctx.settings.max_heatmap_cells
        )
    except HeatmapTooLarge as exc:
        raise HTTPException(422, str(exc)) from None
    head.update(rows=meta.num_tensors, dtype="float64")
    if hm is None:
        matrix = np.zeros((meta.num_tensors, 0))
    else:
        matrix = np.ascontiguousarray(hm["values"], dtype="<f8")  # empty buckets are NaN already
    head["cols"] = matrix.shape[1]
    header = orjson.dumps(head)
    pad = -(4 + len(header)) % 8
    body = struct.pack("<I", len(header)) + header + b"\0" * pad + matrix.tobytes()
    return Response(body, media_type="application/octet-stream")


@router.get("/runs/{run_id}/series/multi")
def get_series_multi(
    run_id: RunId,
    run: RunDep,
    session: SessionDep,
    _principal: ReadDep,
    name: Annotated[list[str], Query(min_length=1, max_length=16, description="scalar names, repeated")],
    from_: FromQ = None,
    to: ToQ = None,
    max_points: Annotated[int, Query(ge=2, le=100_000)] = 2000,
) -> Response:
    """Several scalars at once, each as `GET /runs/{id}/series` gives it (min/max-preserving downsampling),
    read in one pass over the run's steps: `{"from", "to", "series": {name: {"bucket_width", "downsampled",
    "steps", "values"}}}`."""
    if any(not 1 <= len(n) <= 200 for n in name):
        raise HTTPException(422, "name: each scalar name must have 1 to 200 characters")
    check_order(from_, to)
    rng = step_range(run.first_step, run.last_step, from_, to)
    names = list(dict.fromkeys(name))
    out: dict[str, Any] = {"from": None, "to": None, "series": {}}
    if rng is None:
        series = {n: (np.zeros(0, np.int64), np.zeros(0, np.float64)) for n in names}
    else:
        out.update({"from": rng[0], "to": rng[1]})
        series = read_series(session, run_id, names, *rng)
    for n, (steps, values) in series.items():
        kept_steps, kept_values, width = downsample_minmax(steps, values, max_points)
        out["series"][n] = {
            "bucket_width": width,
            "downsampled": len(kept_steps) < len(steps),
            "steps": kept_steps.tolist(),
            "values": jsonable(kept_values.tolist()),
        }
    return Response(orjson.dumps(out), media_type="application/json")
