"""Read paths the web dashboard needs beyond the run routes: who am I, one stream for all runs, several
scalar series from one pass over the steps, and the heatmap as packed float64 (a 512-tensor heatmap is
~8 MB of JSON to parse, ~3.4 MB of binary not to)."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Query, Response
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials

from fp8_protocol.packed import pack_matrix
from monitor_server.api.deps import (
    CtxDep,
    FromQ,
    HeatmapDep,
    ReadDep,
    ReadRunDep,
    RunId,
    SessionDep,
    ToQ,
    authenticate,
    bearer_scheme,
    clipped_range,
)
from monitor_server.api.responses import EVENT_STREAM, event_stream, json_response, model_json
from monitor_server.core.config import SCOPES
from monitor_server.infra.events import ALL_RUNS
from monitor_server.storage.query_schemas import HeatmapPackedHeader, SeriesMulti
from monitor_server.storage.schemas import WhoAmI
from monitor_server.storage.series import read_series, series_points

router = APIRouter(tags=["dashboard"])


@router.get("/whoami", response_model=WhoAmI)
def whoami(
    ctx: CtxDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
) -> WhoAmI:
    """The caller's token name and scopes (401 when tokens are configured and none or an unknown one is
    given). `auth` is false when the server runs without tokens: then everyone holds every scope."""
    principal = authenticate(ctx, credentials)
    scopes = [s for s in SCOPES if s in principal.scopes]
    return WhoAmI(name=principal.name, scopes=scopes, auth=ctx.settings.auth_enabled)


@router.get("/stream", **EVENT_STREAM)
async def stream_all(ctx: CtxDep, principal: ReadDep) -> StreamingResponse:
    """Live events of all runs for the runs list: `step`, `alert` and `run` (each with `run_id`); a newly
    registered run is announced at once as a `run` event with `"created": true`."""
    return event_stream(ctx, ALL_RUNS, principal.name)


@router.get(
    "/runs/{run_id}/heatmap/packed",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "header + float64 matrix"}},
)
def get_heatmap_packed(run_id: RunId, heatmap: HeatmapDep) -> Response:
    """`GET /runs/{id}/heatmap` (same parameters, buckets and aggregation) in the packed layout of
    `fp8_protocol.packed`: the header is `HeatmapPackedHeader` (the JSON answer's fields without `values`,
    plus `rows`, `dtype`: "float64", `cols`), the matrix has a row per metric and tensor (metric-major).
    NaN and infinities are native; cells of a metric's empty buckets (`metric_steps` 0) are NaN."""
    head, hm = heatmap
    rows = len(head.metrics) * len(head.tensors)
    # empty buckets are NaN already
    matrix = np.zeros((rows, 0)) if hm is None else np.ascontiguousarray(hm["values"], dtype="<f8")
    cols = matrix.shape[1]
    header = model_json(HeatmapPackedHeader(**dict(head), rows=rows, dtype="float64", cols=cols))
    return Response(pack_matrix(header, matrix), media_type="application/octet-stream")


@router.get("/runs/{run_id}/series/multi", response_model=SeriesMulti)
def get_series_multi(
    run_id: RunId,
    run: ReadRunDep,
    session: SessionDep,
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
    rng = clipped_range(run, from_, to)
    series = read_series(session, run_id, list(dict.fromkeys(name)), rng)
    lo, hi = rng or (None, None)
    points = {n: series_points(steps, values, max_points) for n, (steps, values) in series.items()}
    return json_response(SeriesMulti(from_step=lo, to_step=hi, series=points))
