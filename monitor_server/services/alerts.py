"""A run's alerts as its routes read and acknowledge them (the alert service that raises them, and
`alert_public`, are `alerting.py`)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from monitor_server.services.incidents import mark_acknowledged, settle_incident
from monitor_server.storage.models import Alert, Incident


def run_alerts(
    session: Session, *, run_id: int, state: str | None, kind: str | None, limit: int
) -> list[Alert]:
    """The run's alerts, most recently updated first, of `state` and `kind` where given; at most `limit`."""
    query = select(Alert).where(Alert.run_id == run_id).order_by(Alert.updated_at.desc(), Alert.id.desc())
    if state is not None:
        query = query.where(Alert.state == state)
    if kind is not None:
        query = query.where(Alert.kind == kind)
    return list(session.execute(query.limit(limit)).scalars())


def open_alerts(session: Session, *, run_id: int) -> list[Alert]:
    """The run's open alerts, by id."""
    query = select(Alert).where(Alert.run_id == run_id, Alert.state == "open").order_by(Alert.id)
    return list(session.execute(query).scalars())


def acknowledge_alert(
    session: Session, *, run_id: int, alert_id: int, who: str, now: datetime
) -> tuple[Alert, Incident | None] | None:
    """Acknowledge one alert of the run (idempotent): the alert, and its incident when that was settled by it
    (its last open alert acknowledged); None when the run has no such alert."""
    alert = session.get(Alert, alert_id)
    if alert is None or alert.run_id != run_id:
        return None
    incident = None
    if alert.state == "open":
        mark_acknowledged(alert, who=who, now=now)
        session.flush()
        incident = settle_incident(session, incident_id=alert.incident_id, who=who, now=now)
    return alert, incident
