"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from monitor_server.api.deps import CtxDep, ReadDep
from monitor_server.api.responses import json_response
from monitor_server.schemas import Health, NotReady

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz(ctx: CtxDep) -> Health:
    """Liveness: the process is up and the database answers."""
    with ctx.db.read_session() as session:
        session.execute(text("SELECT 1"))
    return Health(status="ok", database=ctx.db.engine.dialect.name)


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": NotReady, "description": "the database does not take writes"}},
)
def readyz(ctx: CtxDep) -> Response:
    """Readiness: the database takes a write (a no-op update inside a transaction that is rolled back), so
    a database that answers reads but refuses writes (read-only, full, locked) is not ready."""
    try:
        with ctx.db.write() as session:
            session.execute(text("UPDATE alembic_version SET version_num = version_num"))
            session.rollback()
    except Exception as exc:
        reason = type(getattr(exc, "orig", None) or exc).__name__
        body = NotReady(status="unavailable", database=ctx.db.engine.dialect.name, detail=reason)
        return json_response(body, status_code=503)
    return json_response(Health(status="ready", database=ctx.db.engine.dialect.name))


@router.get("/metrics", response_class=Response)
def metrics(ctx: CtxDep, _principal: ReadDep) -> Response:
    """Prometheus text: ingest counters and latency, open alerts by kind, latest loss/step per run."""
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
