"""Read paths the web dashboard needs beyond the run routes: who am I, one stream for all runs, several
scalar series from one pass over the steps, and the heatmap as packed float64 (a 512-tensor heatmap is
~8 MB of JSON to parse, ~3.4 MB of binary not to)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Depends, HTTPException, Query, Response, status
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy import Text, select, type_coerce

from monitor_server.api.deps import CtxDep, ReadDep, RunId, SessionDep, authenticate, bearer_scheme
from monitor_server.api.routes.queries import FromQ, ToQ
from monitor_server.api.routes.runs import get_run_or_404
from monitor_server.context import AppContext
from monitor_server.core.config import SCOPES
from monitor_server.events import ALL_RUNS, CLOSED, Subscription
from monitor_server.models import StepRow
from monitor_server.rollups import HEATMAP_METRICS, read_heatmap
from monitor_server.series import downsample_minmax
from monitor_server.wire import NONFINITE_STRINGS, jsonable

router = APIRouter(tags=["dashboard"])

#: events of the all-runs stream (what a runs list shows); command and client events stay per run
GLOBAL_EVENTS = frozenset({"step", "alert", "run"})


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


async def _all_runs_events(ctx: AppContext, sub: Subscription) -> AsyncIterator[bytes]:
    """SSE frames of every run's step/alert/run events (a new run: `run` with `"created": true`)."""
    keepalive = ctx.settings.sse_keepalive_seconds
    try:
        yield b": connected\nretry: 2000\n\n"
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        while True:
            event = await sub.get(max(0.05, keepalive - (loop.time() - quiet_since)))
            if event is CLOSED:
                return
            if event is not None and event.name in GLOBAL_EVENTS:
                quiet_since = loop.time()
                yield event.encode()
            if loop.time() - quiet_since >= keepalive:
                quiet_since = loop.time()
                yield b": keep-alive\n\n"
    finally:
        sub.close()


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
        _all_runs_events(ctx, sub),
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
    ctx: CtxDep,
    session: SessionDep,
    _principal: ReadDep,
    metric: Literal["amax", "scale", "overflow", "underflow", "nonfinite", "headroom"] = "amax",
    from_: FromQ = None,
    to: ToQ = None,
    max_cols: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Response:
    """`GET /runs/{id}/heatmap` (same parameters, buckets and aggregation) in a binary layout: a
    little-endian uint32 N, N bytes of JSON (the JSON answer's fields without `values`, plus `rows`, `cols`,
    `dtype`: "float64"), zero bytes up to a multiple of 8, then rows x cols little-endian float64 in row
    (tensor) order. NaN and infinities are native; cells of empty buckets (`bucket_steps` 0) are NaN."""
    run = get_run_or_404(session, run_id)
    meta = ctx.run_meta.get(session, run_id)
    if meta is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} has no tensors")
    if from_ is not None and to is not None and to < from_:
        raise HTTPException(422, f"to ({to}) is before from ({from_})")
    head: dict[str, Any] = {
        "metric": metric,
        "aggregation": HEATMAP_METRICS[metric][1],
        "tensors": [asdict(t) for t in meta.tensors],
        "rows": meta.num_tensors,
        "dtype": "float64",
    }
    lo = run.first_step if from_ is None or run.first_step is None else max(from_, run.first_step)
    hi = run.last_step if to is None or run.last_step is None else min(to, run.last_step)
    if lo is None or hi is None or lo > hi:
        head.update(cols=0, bucket_width=1, bucket_start=[], bucket_end=[], bucket_steps=[])
        matrix = np.zeros((meta.num_tensors, 0))
    else:
        hm = read_heatmap(session, run_id, metric, lo, hi, max_cols, meta.fp8_max)
        matrix = np.array(hm["values"], dtype="<f8", order="C")
        matrix[:, hm["empty"]] = np.nan
        head.update(
            cols=matrix.shape[1],
            bucket_width=hm["width"],
            bucket_start=hm["starts"].tolist(),
            bucket_end=hm["ends"].tolist(),
            bucket_steps=hm["steps"].tolist(),
        )
    header = orjson.dumps(head)
    pad = -(4 + len(header)) % 8
    body = struct.pack("<I", len(header)) + header + b"\0" * pad + matrix.tobytes()
    return Response(body, media_type="application/octet-stream")


def _scalar(raw: object) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int | float):
        return float(raw)
    return NONFINITE_STRINGS.get(raw) if isinstance(raw, str) else None


@router.get("/runs/{run_id}/series/multi")
def get_series_multi(
    run_id: RunId,
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
    if from_ is not None and to is not None and to < from_:
        raise HTTPException(422, f"to ({to}) is before from ({from_})")
    run = get_run_or_404(session, run_id)
    lo = run.first_step if from_ is None or run.first_step is None else max(from_, run.first_step)
    hi = run.last_step if to is None or run.last_step is None else min(to, run.last_step)
    names = list(dict.fromkeys(name))
    out: dict[str, Any] = {"from": None, "to": None, "series": {}}
    rows = []
    if lo is not None and hi is not None and lo <= hi:
        out.update({"from": lo, "to": hi})
        # the JSON as text, parsed here by orjson: several times faster than the driver's json.loads
        raw = session.execute(
            select(StepRow.step, type_coerce(StepRow.scalars, Text))
            .where(StepRow.run_id == run_id, StepRow.step.between(lo, hi))
            .order_by(StepRow.step)
        ).all()
        rows = [(s, orjson.loads(sc) if isinstance(sc, str | bytes) else sc) for s, sc in raw]
    for n in names:
        pairs = [(s, v) for s, sc in rows if (v := _scalar((sc or {}).get(n))) is not None]
        steps = np.fromiter((p[0] for p in pairs), np.int64, len(pairs))
        values = np.fromiter((p[1] for p in pairs), np.float64, len(pairs))
        kept_steps, kept_values, width = downsample_minmax(steps, values, max_points)
        out["series"][n] = {
            "bucket_width": width,
            "downsampled": len(kept_steps) < len(steps),
            "steps": kept_steps.tolist(),
            "values": jsonable(kept_values.tolist()),
        }
    return Response(orjson.dumps(out), media_type="application/json")
