"""Alerts: list (open and acknowledged, newest first) and acknowledge."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from sqlalchemy import select

from monitor_server.alerting import alert_public
from monitor_server.api.deps import AlertId, AlertStateQ, ControlDep, CtxDep, ReadRunDep, RunId, SessionDep
from monitor_server.incidents import settle_incident
from monitor_server.models import Alert, utcnow
from monitor_server.schemas import AlertPublic
from monitor_server.wire import iso_dates

router = APIRouter(prefix="/runs", tags=["alerts"])


@router.get("/{run_id}/alerts", response_model=list[AlertPublic])
def list_alerts(
    run_id: RunId,
    _run: ReadRunDep,
    ctx: CtxDep,
    session: SessionDep,
    state: AlertStateQ = None,
    kind: Annotated[str | None, Query(max_length=32, description="only alerts of this kind")] = None,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> list[AlertPublic]:
    """The run's alerts, newest first (most recently updated first), optionally filtered by state and kind."""
    meta = ctx.run_meta.get(session, run_id)
    query = select(Alert).where(Alert.run_id == run_id).order_by(Alert.updated_at.desc(), Alert.id.desc())
    if state is not None:
        query = query.where(Alert.state == state)
    if kind is not None:
        query = query.where(Alert.kind == kind)
    return [AlertPublic(**alert_public(a, meta)) for a in session.execute(query.limit(limit)).scalars()]


@router.post("/{run_id}/alerts/{alert_id}/ack", response_model=AlertPublic)
def ack_alert(run_id: RunId, alert_id: AlertId, ctx: CtxDep, principal: ControlDep) -> AlertPublic:
    """Acknowledge an alert (idempotent). A later finding of the same kind and tensor opens a new alert.
    Acknowledging the last open alert of an incident acknowledges the incident."""
    incident_out = None
    with ctx.db.run_lock(run_id), ctx.db.write() as session:
        alert = session.get(Alert, alert_id)
        if alert is None or alert.run_id != run_id:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"alert {alert_id} not found in run {run_id}")
        if alert.state == "open":
            alert.state = "acknowledged"
            alert.acknowledged_at = utcnow()
            alert.acknowledged_by = principal.name
            alert.updated_at = alert.acknowledged_at
            session.flush()
            incident = settle_incident(session, alert.incident_id, principal.name, alert.acknowledged_at)
            if incident is not None:
                incident_out = ctx.detection.incidents_public(session, run_id, [incident])[0]
        public = alert_public(alert, ctx.run_meta.get(session, run_id))
    ctx.broker.publish(run_id, "alert", iso_dates(public))
    if incident_out is not None:
        ctx.broker.publish(run_id, "incident", iso_dates(incident_out))
    return AlertPublic(**public)
