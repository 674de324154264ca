"""Incident replays: the report of ``fp8-train replay`` stored on its incident, and the incident bundles the
job wrote, as an incident shows them.

A replay report (`monitor_server.storage.schemas.ReplayReport`: verdict, reason, culprits, the evidence per
configuration) is stored as the job sent it, one per incident; a second one replaces the first (a replay
rerun with bisection after one without). The incident as the API shows it carries the verdict
(``replay_verdict``) and the paths of the bundles the job reported with its ``incident_bundle`` events
(``custom`` events with ``details["name"] == "incident_bundle"`` and ``details["path"]``): those from
`window` steps before the incident's first step (the window within which an alert joins an incident) to its
last step. The paths are the job's own: where the bundle lies on the machine that trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from fp8_protocol.client_events import CUSTOM_EVENT
from fp8_protocol.replay import INCIDENT_BUNDLE_EVENT
from monitor_server.infra.wire import SUMMARY_TEXT_CHARS
from monitor_server.storage.models import EventRow, Incident, IncidentReplay, as_utc

#: the most bundle paths one incident lists (a job writes at most a few per run)
MAX_BUNDLES = 16


def get_replay(session: Session, incident_id: int) -> IncidentReplay | None:
    """The stored replay of an incident, or None."""
    return session.get(IncidentReplay, incident_id)


def store_replay(
    session: Session, *, incident: Incident, report: dict[str, Any], who: str, now: datetime
) -> IncidentReplay:
    """Store `report` (validated, JSON-able) as the replay of `incident`, replacing one stored before."""
    row = session.get(IncidentReplay, incident.id)
    if row is None:
        row = IncidentReplay(incident_id=incident.id, run_id=incident.run_id, created_at=now)
        session.add(row)
    row.verdict = report["verdict"]
    row.report = report
    row.updated_at = now
    row.updated_by = who
    session.flush()
    return row


def replay_public(row: IncidentReplay) -> dict[str, Any]:
    """A stored replay as the API returns it: the report and where it belongs, who stored it when."""
    return {
        **row.report,
        "incident_id": row.incident_id,
        "run_id": row.run_id,
        "created_at": as_utc(row.created_at),
        "updated_at": as_utc(row.updated_at),
        "updated_by": row.updated_by,
    }


def bundle_paths(session: Session, *, run_id: int, lo: int, hi: int) -> list[tuple[int, str]]:
    """(step, path) of the run's ``incident_bundle`` events at steps lo..hi, by step. Reads the events'
    summaries (their top-level texts), and the details only of an event whose path the summary cut short."""
    query = (
        select(EventRow.id, EventRow.step, EventRow.summary)
        .where(EventRow.run_id == run_id, EventRow.kind == CUSTOM_EVENT)
        .where(EventRow.step >= lo, EventRow.step <= hi)
        .order_by(EventRow.step, EventRow.id)
    )
    out: list[tuple[int, str]] = []
    for row in session.execute(query):
        event_id, step, stored = row[0], row[1], row[2]
        summary: dict[str, Any] = stored or {}
        path = summary.get("path")
        bundle = summary.get("name") == INCIDENT_BUNDLE_EVENT
        if bundle and isinstance(path, str) and len(path) >= SUMMARY_TEXT_CHARS:
            event = session.get(EventRow, event_id)  # the summary keeps a text's start
            path = event.details.get("path") if event is not None else None
        if bundle and isinstance(path, str) and path:
            out.append((int(step), path))
    return out


def annotate(
    session: Session,
    *,
    run_id: int,
    incidents: Sequence[Incident],
    publics: list[dict[str, Any]],
    window: int,
) -> None:
    """Add ``replay_verdict`` and ``bundles`` to the incidents as the API shows them (`publics`, in the
    order of `incidents`): two queries for all of them."""
    if not incidents:
        return
    ids = [i.id for i in incidents]
    query = select(IncidentReplay.incident_id, IncidentReplay.verdict)
    verdicts = {i: v for i, v in session.execute(query.where(IncidentReplay.incident_id.in_(ids)))}
    lo = max(0, min(i.first_step for i in incidents) - window)
    bundles = bundle_paths(session, run_id=run_id, lo=lo, hi=max(i.last_step for i in incidents))
    for incident, public in zip(incidents, publics, strict=True):
        public["replay_verdict"] = verdicts.get(incident.id)
        paths = [p for s, p in bundles if incident.first_step - window <= s <= incident.last_step]
        public["bundles"] = list(dict.fromkeys(paths))[:MAX_BUNDLES]
