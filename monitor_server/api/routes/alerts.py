"""Alerts: list (open and acknowledged, newest first) and acknowledge."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from monitor_server.api.deps import AlertId, AlertStateQ, ControlDep, CtxDep, ReadRunDep, RunId, SessionDep
from monitor_server.services.alert_records import alert_public
from monitor_server.services.alerts import acknowledge_alert, run_alerts
from monitor_server.storage.models import utcnow
from monitor_server.storage.schemas import AlertPublic

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
    alerts = run_alerts(session, run_id=run_id, state=state, kind=kind, limit=limit)
    return [AlertPublic.model_validate(alert_public(a, meta)) for a in alerts]


@router.post("/{run_id}/alerts/{alert_id}/ack", response_model=AlertPublic)
def ack_alert(run_id: RunId, alert_id: AlertId, ctx: CtxDep, principal: ControlDep) -> AlertPublic:
    """Acknowledge an alert (idempotent). A later finding of the same kind and tensor opens a new alert.
    Acknowledging the last open alert of an incident acknowledges the incident."""
    incident_out = None
    with ctx.db.run_lock(run_id), ctx.db.write() as session:
        found = acknowledge_alert(session, run_id=run_id, alert_id=alert_id, who=principal.name, now=utcnow())
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"alert {alert_id} not found in run {run_id}")
        alert, incident = found
        if incident is not None:
            incident_out = ctx.detection.incidents_public(session, run_id, [incident])[0]
        public = alert_public(alert, ctx.run_meta.get(session, run_id))
    ctx.broker.publish(run_id, "alert", public)
    if incident_out is not None:
        ctx.broker.publish(run_id, "incident", incident_out)
    return AlertPublic.model_validate(public)
