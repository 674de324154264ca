"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import os
import shutil

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from monitor_server.api.context import AppContext
from monitor_server.api.deps import CtxDep, ReadDep
from monitor_server.api.responses import json_response
from monitor_server.storage.schemas import Health, NotReady

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz(ctx: CtxDep) -> Health:
    """Liveness: the process is up and the database answers."""
    ctx.db.ping()
    return Health(status="ok", database=ctx.db.engine.dialect.name)


def sqlite_free_bytes(ctx: AppContext) -> int | None:
    """Free bytes on the file system of the SQLite database file (None: PostgreSQL, or an in-memory file)."""
    path = ctx.db.engine.url.database if ctx.db.sqlite else None
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    return shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": NotReady, "description": "the database does not take writes"}},
)
def readyz(ctx: CtxDep) -> Response:
    """Readiness: the database takes a write, so one that answers reads but refuses writes (read-only,
    full, locked) is not ready. A real row is written and rolled back (into `alembic_version`: no sequence
    to advance, nothing that references it). SQLite writes a transaction's pages only when it commits, so
    there a full disk is seen directly: the file system of the database must have room for one largest
    batch (`max_body_bytes`), else the answer is 503 `DiskFull`."""
    database = ctx.db.engine.dialect.name
    try:
        ctx.db.probe_write()
        free = sqlite_free_bytes(ctx)
        if free is not None and free < ctx.settings.max_body_bytes:
            return json_response(NotReady(status="unavailable", database=database, detail="DiskFull"), 503)
    except Exception as exc:
        reason = type(getattr(exc, "orig", None) or exc).__name__
        return json_response(NotReady(status="unavailable", database=database, detail=reason), 503)
    return json_response(Health(status="ready", database=database))


@router.get("/metrics", response_class=Response)
def metrics(ctx: CtxDep, _principal: ReadDep) -> Response:
    """Prometheus text: ingest counters and latency, open alerts by kind, latest loss/step per run."""
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
