"""Liveness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from monitor_server.api.deps import CtxDep, ReadDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(ctx: CtxDep) -> dict[str, str]:
    """Liveness: the process is up and the database answers."""
    with ctx.db.read_session() as session:
        session.execute(text("SELECT 1"))
    return {"status": "ok", "database": ctx.db.engine.dialect.name}


@router.get("/metrics", response_class=Response)
def metrics(ctx: CtxDep, _principal: ReadDep) -> Response:
    """Prometheus text: ingest counters and latency, open alerts by kind, latest loss/step per run."""
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
