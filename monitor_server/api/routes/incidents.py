"""Incidents: list (newest first, alerts root cause first), one in full, acknowledge one or all."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from monitor_server.api.context import AppContext
from monitor_server.api.deps import (
    AlertStateQ,
    ControlDep,
    CtxDep,
    IncidentId,
    ReadIncidentDep,
    ReadRunDep,
    RunId,
    SessionDep,
    incident_or_404,
    run_or_404,
)
from monitor_server.services.alert_records import alert_public
from monitor_server.services.incidents import acknowledge, incident_alerts, incidents_by_id, run_incidents
from monitor_server.storage.models import utcnow
from monitor_server.storage.schemas import AckAllResult, IncidentDetail, IncidentPublic

router = APIRouter(prefix="/runs", tags=["incidents"])


@router.get("/{run_id}/incidents", response_model=list[IncidentPublic])
def list_incidents(
    run_id: RunId,
    _run: ReadRunDep,
    ctx: CtxDep,
    session: SessionDep,
    state: AlertStateQ = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[IncidentPublic]:
    """The run's incidents, newest first; each lists its alerts root cause first."""
    found = run_incidents(session, run_id=run_id, state=state, limit=limit)
    incidents = ctx.detection.incidents_public(session, run_id, found)
    return [IncidentPublic.model_validate(incident) for incident in incidents]


@router.get("/{run_id}/incidents/{incident_id}", response_model=IncidentDetail)
def get_incident(incident: ReadIncidentDep, ctx: CtxDep, session: SessionDep) -> IncidentDetail:
    """One incident, with its alerts in full (evidence included) as ``alerts_full``, root cause first."""
    public = ctx.detection.incidents_public(session, incident.run_id, [incident])[0]
    meta = ctx.run_meta.get(session, incident.run_id)
    alerts = incident_alerts(session, incident_id=incident.id, order=ctx.detection.tensor_order(meta))
    return IncidentDetail.model_validate({**public, "alerts_full": [alert_public(a, meta) for a in alerts]})


def _ack(
    ctx: AppContext, run_id: int, ids: list[int] | None, who: str
) -> tuple[list[IncidentPublic], list[int], int]:
    """Acknowledge under the run's lock (ingest holds it while it adds alerts to open incidents), then
    publish; returns the incidents as the API shows them, their ids and the number of alerts acknowledged."""
    with ctx.db.run_lock(run_id), ctx.db.write() as session:
        run_or_404(session, run_id)
        incidents, alerts = acknowledge(session, run_id=run_id, incident_ids=ids, who=who, now=utcnow())
        if ids is not None:  # already acknowledged ones are returned as they are (idempotent)
            incidents = incidents_by_id(session, ids)
        meta = ctx.run_meta.get(session, run_id)
        alerts_out = [alert_public(a, meta) for a in alerts]
        incidents_out = ctx.detection.incidents_public(session, run_id, incidents)
    for public in alerts_out:
        ctx.broker.publish(run_id, "alert", public)
    for public in incidents_out:
        ctx.broker.publish(run_id, "incident", public)
    public = [IncidentPublic.model_validate(i) for i in incidents_out]
    return public, [i.id for i in public], len(alerts_out)


@router.post("/{run_id}/incidents/ack", response_model=AckAllResult)
def ack_all(run_id: RunId, ctx: CtxDep, principal: ControlDep) -> AckAllResult:
    """Acknowledge every open incident of the run and every open alert (also those in no incident)."""
    _, ids, n_alerts = _ack(ctx, run_id, None, principal.name)
    return AckAllResult(incidents=ids, alerts=n_alerts)


@router.post("/{run_id}/incidents/{incident_id}/ack", response_model=IncidentPublic)
def ack_incident(
    run_id: RunId, incident_id: IncidentId, ctx: CtxDep, principal: ControlDep
) -> IncidentPublic:
    """Acknowledge an incident and its open alerts (idempotent). Later findings open a new incident."""
    with ctx.db.read_session() as session:
        incident_or_404(session, run_id, incident_id)
    incidents, _, _ = _ack(ctx, run_id, [incident_id], principal.name)
    return incidents[0]
