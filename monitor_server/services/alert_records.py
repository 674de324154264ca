"""The persistence side of the alert service (`monitor_server.services.alerting`): findings folded into
a run's open alerts, grouped into incidents (`monitor_server.services.incidents`), each incident's webhook
message claimed once, and the reads of the stall check.

Each incident's webhook message is claimed with an atomic ``UPDATE ... WHERE notified_at IS NULL``, so it
is sent once whichever server instance raised it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from monitor_server.detectors.types import Finding
from monitor_server.services import replays
from monitor_server.services.incidents import (
    SEVERITY_RANK,
    TensorOrder,
    alert_summary,
    alerts_by_incident,
    incident_public,
    worse,
)
from monitor_server.storage.models import Alert, Incident, Run, as_utc, utcnow
from monitor_server.storage.run_meta import RunMeta


def alert_public(alert: Alert, meta: RunMeta | None) -> dict[str, Any]:
    """An alert as the API returns it: its summary within an incident (tensor name and layer resolved from
    the run's tensors) and the rest of its record."""
    return {
        **alert_summary(alert, meta),
        "run_id": alert.run_id,
        "incident_id": alert.incident_id,
        "evidence": alert.evidence,
        "created_at": as_utc(alert.created_at),
        "updated_at": as_utc(alert.updated_at),
        "acknowledged_at": as_utc(alert.acknowledged_at),
        "acknowledged_by": alert.acknowledged_by,
    }


def incidents_public(
    session: Session,
    incidents: Sequence[Incident],
    *,
    run_id: int,
    meta: RunMeta | None,
    order: TensorOrder,
    public_url: str,
    window: int,
) -> list[dict[str, Any]]:
    """Incidents as the API returns them (alerts root cause first, link under the public URL, replay
    verdicts and incident bundles within `window` steps before them)."""
    alerts = alerts_by_incident(session, [i.id for i in incidents])
    out = [incident_public(i, alerts[i.id], meta, order, public_url) for i in incidents]
    replays.annotate(session, run_id=run_id, incidents=incidents, publics=out, window=window)
    return out


def store_findings(session: Session, *, run_id: int, findings: list[Finding]) -> list[tuple[Alert, bool]]:
    """Fold findings into the open alerts of a run: one open alert per (kind, tensor), updated (last step,
    count, evidence, message, severity = max) rather than duplicated.

    Returns each touched alert and whether it is new. Evidence is stored as the engine encoded it.
    """
    groups: dict[tuple[str, int], list[Finding]] = {}
    for finding in findings:
        key = finding.tensor_index if finding.tensor_index is not None else -1
        groups.setdefault((finding.kind, key), []).append(finding)
    if not groups:
        return []
    kinds = sorted({kind for kind, _ in groups})
    open_alerts = {
        (a.kind, a.tensor_key): a
        for a in session.scalars(
            select(Alert).where(Alert.run_id == run_id, Alert.state == "open", Alert.kind.in_(kinds))
        )
    }
    now = utcnow()
    touched: list[tuple[Alert, bool]] = []
    for (kind, key), group in groups.items():
        alert = open_alerts.get((kind, key))
        is_new = alert is None
        if alert is None:
            first = group[0]
            alert = Alert(
                run_id=run_id,
                kind=kind,
                tensor_index=first.tensor_index,
                tensor_key=key,
                state="open",
                severity=first.severity,
                message=first.message,
                first_step=first.step,
                last_step=first.step,
                onset_step=min(f.onset_step for f in group),
                count=0,
                evidence={},
                created_at=now,
            )
            session.add(alert)
        for finding in group:
            alert.severity = worse(alert.severity, finding.severity)
            alert.last_step = max(alert.last_step, finding.step)
        alert.count += len(group)
        alert.evidence = dict(group[-1].evidence)
        alert.message = group[-1].message
        alert.updated_at = now
        touched.append((alert, is_new))
    session.flush()
    return touched


def claim_notifications(
    session: Session, incidents: list[Incident], *, min_severity: str, now: datetime
) -> list[int]:
    """Claim the webhook message of each incident that first deserves one (at least `min_severity`, none
    sent yet); returns the ids claimed. Whichever transaction sets `notified_at` first sends it (another
    instance may have raced this one to it)."""
    floor = SEVERITY_RANK[min_severity]
    claimed_ids: list[int] = []
    for incident in incidents:
        if incident.notified_at is None and SEVERITY_RANK.get(incident.severity, 0) >= floor:
            claim = (
                update(Incident)
                .where(Incident.id == incident.id, Incident.notified_at.is_(None))
                .values(notified_at=now)
                .execution_options(synchronize_session=False)
            )
            claimed = cast(CursorResult[Any], session.execute(claim))  # an UPDATE's result has a rowcount
            if claimed.rowcount == 1:
                set_committed_value(incident, "notified_at", now)
                claimed_ids.append(incident.id)
    return claimed_ids


def running_runs(session: Session) -> list[tuple[int, datetime | None, datetime, int | None]]:
    """(id, last telemetry, created, last step) of every running run: what the stall check looks at."""
    query = select(Run.id, Run.last_telemetry_at, Run.created_at, Run.last_step)
    query = query.where(Run.status == "running")
    return [(r[0], r[1], r[2], r[3]) for r in session.execute(query)]


def open_stalls(session: Session) -> dict[int, tuple[int, str]]:
    """Per run, the (last step, severity) of its open `stalled` alert."""
    query = select(Alert.run_id, Alert.last_step, Alert.severity).where(
        Alert.kind == "stalled", Alert.state == "open"
    )
    return {run_id: (last_step, severity) for run_id, last_step, severity in session.execute(query)}


def stall_seen(session: Session, *, run_id: int, finding: Finding) -> bool:
    """Whether the run's open `stalled` alert already says this (same step, same or worse severity), or
    the run is no longer running; read under the run's row lock."""
    status = session.scalar(select(Run.status).where(Run.id == run_id).with_for_update())
    if status != "running":
        return True
    seen = session.execute(
        select(Alert.last_step, Alert.severity).where(
            Alert.run_id == run_id, Alert.kind == "stalled", Alert.state == "open"
        )
    ).first()
    return stall_known(None if seen is None else (seen[0], seen[1]), finding)


def stall_known(seen: tuple[int, str] | None, finding: Finding) -> bool:
    """Whether an open stall alert at (last step, severity) `seen` already says what `finding` says."""
    rank = SEVERITY_RANK
    return seen is not None and seen[0] == finding.step and rank[seen[1]] >= rank[finding.severity]
