"""Incident replays: store the report of ``fp8-train replay`` on its incident, read it back."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from monitor_server.api.deps import (
    CtxDep,
    IncidentId,
    ReadIncidentDep,
    RunId,
    RunWriteDep,
    SessionDep,
    incident_or_404,
    run_or_404,
)
from monitor_server.core.security import check_owner
from monitor_server.services.commands import command_public
from monitor_server.services.policies import on_replay
from monitor_server.services.replays import get_replay, replay_public, store_replay
from monitor_server.storage.models import utcnow
from monitor_server.storage.schemas import ReplayPublic, ReplayReport

router = APIRouter(prefix="/runs", tags=["incidents"])


@router.put("/{run_id}/incidents/{incident_id}/replay", response_model=ReplayPublic)
def put_incident_replay(
    run_id: RunId, incident_id: IncidentId, body: ReplayReport, ctx: CtxDep, principal: RunWriteDep
) -> ReplayPublic:
    """Store the report of a replay of the incident's captured step (``fp8-train replay BUNDLE
    --monitor-url ... --run-id ... --incident ...``), replacing one stored before. The job that owns the run
    (an `ingest` token) or an operator (`control`) may. The incident shows the verdict from then on. A run
    with a remediation policy (its config's ``remediation``) gets the policy's command queued or proposed
    (``GET .../policy-actions``)."""
    report = body.model_dump(mode="json", exclude_none=True)
    with ctx.db.run_lock(run_id), ctx.db.write() as session:
        run = run_or_404(session, run_id)
        check_owner(principal, run.owner, run_id)
        incident = incident_or_404(session, run_id, incident_id)
        now = utcnow()
        row = store_replay(session, incident=incident, report=report, who=principal.name, now=now)
        result = ReplayPublic.model_validate(replay_public(row))
        incident_out = ctx.detection.incidents_public(session, run_id, [incident])[0]
        meta = ctx.run_meta.get(session, run_id)
        layers = set(meta.layers) if meta else set()
        # the run's remediation policy, if it has one, acts on (or proposes) a change (policies.py)
        queued = [
            command_public(c)
            for c in on_replay(session, run=run, incident=incident, report=report, layers=layers, now=now)
        ]
    ctx.broker.publish(run_id, "incident", incident_out)
    for command in queued:
        ctx.broker.publish(run_id, "command", command)
    return result


@router.get(
    "/{run_id}/incidents/{incident_id}/replay",
    response_model=ReplayPublic,
    responses={404: {"description": "no such incident, or it has not been replayed"}},
)
def get_incident_replay(incident: ReadIncidentDep, session: SessionDep) -> ReplayPublic:
    """The stored replay of the incident: verdict, reason, culprits (most likely first), the evidence per
    configuration (losses, fault, output SQNRs against high precision). 404 when it has none."""
    row = get_replay(session, incident.id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"incident {incident.id} has no replay yet")
    return ReplayPublic.model_validate(replay_public(row))
