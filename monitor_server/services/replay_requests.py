"""Replay requests: the incident page asks for a bundle to be replayed, a replay worker claims and runs it.

A bundle lies where the job trained, so the service never replays one itself: a person (a `control` token)
requests the replay of one of an incident's bundles; a replay worker (``fp8-monitor replay-worker``,
`monitor_server/infra/replay_worker.py`) on a machine that sees the bundles claims the oldest pending
request, runs ``fp8-train replay`` onto the incident (which stores the report, and lets the run's policy
act on it, as a replay run by hand does), and says how it ended. One request per incident is open
(pending or running) at a time: asking again returns it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from monitor_server.storage.models import Incident, ReplayRequest
from monitor_server.storage.schemas import ReplayRequestPublic, attributes

#: the states of a request that is still open (a second request for its incident returns it)
OPEN = ("pending", "running")
#: the most requests one listing returns
MAX_LISTED = 200


def request_public(row: ReplayRequest) -> dict[str, Any]:
    """A request as the stream carries it: `ReplayRequestPublic`'s fields, in its order."""
    return attributes(row, ReplayRequestPublic.model_fields)


def open_request(session: Session, *, incident_id: int) -> ReplayRequest | None:
    """The incident's pending or running request, if any."""
    query = select(ReplayRequest).where(
        ReplayRequest.incident_id == incident_id, ReplayRequest.state.in_(OPEN)
    )
    return session.scalars(query.order_by(ReplayRequest.id).limit(1)).first()


def request_replay(
    session: Session, *, incident: Incident, bundle: str, by: str, now: datetime
) -> tuple[ReplayRequest, bool]:
    """(the request, True when made now): a new pending request for `bundle` of `incident`, or the
    incident's open one."""
    existing = open_request(session, incident_id=incident.id)
    if existing is not None:
        return existing, False
    row = ReplayRequest(
        run_id=incident.run_id,
        incident_id=incident.id,
        bundle=bundle,
        state="pending",
        requested_by=by,
        created_at=now,
        updated_at=now,
    )
    session.add(row)
    session.flush()
    return row, True


def list_requests(
    session: Session, *, run_id: int | None = None, state: str | None = None
) -> list[ReplayRequest]:
    """Requests by id (oldest first), of one run and/or in one state, at most `MAX_LISTED`."""
    query = select(ReplayRequest)
    if run_id is not None:
        query = query.where(ReplayRequest.run_id == run_id)
    if state is not None:
        query = query.where(ReplayRequest.state == state)
    return list(session.scalars(query.order_by(ReplayRequest.id).limit(MAX_LISTED)))


def get_request(session: Session, *, request_id: int) -> ReplayRequest | None:
    return session.get(ReplayRequest, request_id)


def claim(session: Session, *, row: ReplayRequest, by: str, now: datetime) -> bool:
    """Take a pending request for the worker `by` (False: it is not pending any more). The caller holds
    the row's run lock, so two workers cannot both take it."""
    if row.state != "pending":
        return False
    row.state, row.claimed_by, row.updated_at = "running", by, now
    return True


def finish(session: Session, *, row: ReplayRequest, state: str, detail: str | None, now: datetime) -> None:
    """Close a running request as `done` or `failed` (with why)."""
    row.state, row.detail, row.updated_at = state, detail, now
