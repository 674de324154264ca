"""Replay requests: the incident page's "Replay" button, and the replay worker's queue
(`monitor_server/services/replay_requests.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response, status
from sqlalchemy.orm import Session

from monitor_server.api.deps import (
    ControlDep,
    CtxDep,
    IncidentId,
    ReadRunDep,
    RequestId,
    RunId,
    SessionDep,
    incident_or_404,
    run_or_404,
)
from monitor_server.services import replay_requests as requests
from monitor_server.storage.models import ReplayRequest, utcnow
from monitor_server.storage.schemas import ReplayRequestCreate, ReplayRequestFinish, ReplayRequestPublic

router = APIRouter(tags=["incidents"])


@router.post(
    "/runs/{run_id}/incidents/{incident_id}/replay-requests",
    response_model=ReplayRequestPublic,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"description": "the incident's request still open (pending or running)"},
        409: {"description": "the incident lists no bundle to replay"},
        422: {"description": "`bundle` is not one of the incident's bundles"},
    },
)
def request_replay(
    run_id: RunId,
    incident_id: IncidentId,
    body: ReplayRequestCreate,
    ctx: CtxDep,
    principal: ControlDep,
    response: Response,
) -> ReplayRequestPublic:
    """Ask a replay worker (``fp8-monitor replay-worker``) to replay one of the incident's bundles onto it
    (default: the newest). The report is stored on the incident as ``fp8-train replay`` stores it."""
    with ctx.db.run_lock(run_id), ctx.db.write() as session:
        run_or_404(session, run_id)
        incident = incident_or_404(session, run_id, incident_id)
        bundles = ctx.detection.incidents_public(session, run_id, [incident])[0]["bundles"]
        if not bundles:
            raise HTTPException(409, f"incident {incident_id} lists no bundle: the job captured none for it")
        bundle = bundles[-1] if body.bundle is None else body.bundle
        if bundle not in bundles:
            raise HTTPException(422, f"bundle: not one of incident {incident_id}'s bundles {bundles}")
        row, made = requests.request_replay(
            session, incident=incident, bundle=bundle, by=principal.name, now=utcnow()
        )
        public = requests.request_public(row)
    if made:
        ctx.broker.publish(run_id, "replay_request", public)
    else:
        response.status_code = status.HTTP_200_OK
    return ReplayRequestPublic.model_validate(public)


@router.get("/runs/{run_id}/replay-requests", response_model=list[ReplayRequestPublic])
def list_run_requests(run_id: RunId, _run: ReadRunDep, session: SessionDep) -> list[ReplayRequestPublic]:
    """The run's replay requests, oldest first (the incident page shows each incident's newest)."""
    rows = requests.list_requests(session, run_id=run_id)
    return [ReplayRequestPublic.model_validate(r, from_attributes=True) for r in rows]


@router.get("/replay-requests", response_model=list[ReplayRequestPublic])
def list_all_requests(
    session: SessionDep,
    _principal: ControlDep,
    state: Annotated[
        str | None, Query(pattern="^(pending|running|done|failed)$", description="only those in this state")
    ] = None,
) -> list[ReplayRequestPublic]:
    """Every run's replay requests, oldest first, at most 200: a worker asks for ``state=pending``."""
    rows = requests.list_requests(session, state=state)
    return [ReplayRequestPublic.model_validate(r, from_attributes=True) for r in rows]


def _request_or_404(ctx: CtxDep, request_id: int) -> int:
    """The run of request `request_id` (404 when there is none)."""
    with ctx.db.read_session() as session:
        row = requests.get_request(session, request_id=request_id)
        if row is None:
            raise HTTPException(404, f"replay request {request_id} not found")
        return row.run_id


def _change_request(
    ctx: CtxDep, request_id: int, change: Callable[[Session, ReplayRequest], None]
) -> ReplayRequestPublic:
    """Apply `change` to request `request_id` under its run's lock (the worker's claim and finish: `change`
    raises to refuse), then show the request changed on the run's stream; 404 when there is none."""
    run_id = _request_or_404(ctx, request_id)
    with ctx.db.run_lock(run_id), ctx.db.write() as session:
        row = requests.get_request(session, request_id=request_id)
        if row is None:
            raise HTTPException(404, f"replay request {request_id} not found")
        change(session, row)
        public = requests.request_public(row)
    ctx.broker.publish(run_id, "replay_request", public)
    return ReplayRequestPublic.model_validate(public)


@router.post(
    "/replay-requests/{request_id}/claim",
    response_model=ReplayRequestPublic,
    responses={409: {"description": "the request is not pending (another worker took it, or it ended)"}},
)
def claim_request(request_id: RequestId, ctx: CtxDep, principal: ControlDep) -> ReplayRequestPublic:
    """Take a pending request for the calling worker: `running` from now, and no other worker gets it."""

    def claim(session: Session, row: ReplayRequest) -> None:
        if not requests.claim(session, row=row, by=principal.name, now=utcnow()):
            raise HTTPException(409, f"replay request {request_id} is {row.state}, not pending")

    return _change_request(ctx, request_id, claim)


@router.post(
    "/replay-requests/{request_id}/finish",
    response_model=ReplayRequestPublic,
    responses={409: {"description": "the request is not running"}},
)
def finish_request(
    request_id: RequestId, body: ReplayRequestFinish, ctx: CtxDep, _principal: ControlDep
) -> ReplayRequestPublic:
    """Say how a claimed request ended: `done` (the replay stored its report) or `failed` (with why)."""

    def finish(session: Session, row: ReplayRequest) -> None:
        if row.state != "running":
            raise HTTPException(409, f"replay request {request_id} is {row.state}, not running")
        requests.finish(session, row=row, state=body.state, detail=body.detail, now=utcnow())

    return _change_request(ctx, request_id, finish)
