"""Client events (loss spikes, non-finite values, rank amaxes, custom) as the API shows them: light in
lists and on the stream, whole one at a time."""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, null, select
from sqlalchemy.orm import Session

from monitor_server.infra.wire import details_summary
from monitor_server.storage.models import EventRow, as_utc
from monitor_server.storage.schemas import EventPublic, attributes

#: event details up to this size (as JSON) travel whole in lists and on the stream; larger ones as their
#: summary, the whole details from `GET /runs/{id}/events/{event_id}`
INLINE_DETAIL_BYTES = 4096


def event_light(event: dict[str, Any]) -> dict[str, Any]:
    """The light form of an event (as lists and the stream carry it): `details` whole when small, else
    its summary, with `details_bytes` and `details_complete` saying which."""
    size = event.get("details_bytes") or 0
    complete = size <= INLINE_DETAIL_BYTES and event.get("details") is not None
    # summarized again: bounds a summary stored before its key and size bounds
    details = event["details"] if complete else details_summary(event.get("summary") or {})
    out = {k: v for k, v in event.items() if k not in ("details", "summary")}
    return {**out, "details": details, "details_bytes": size, "details_complete": complete}


def event_public(event: EventRow) -> EventPublic:
    """An event whole, as `GET /runs/{id}/events/{event_id}` returns it."""
    return EventPublic(
        **attributes(event, ("id", "run_id", "kind", "step", "details")),
        details_bytes=event.details_bytes or 0,
        details_complete=True,
        created_at=as_utc(event.created_at),
    )


def run_events(
    session: Session, *, run_id: int, kind: str | None, lo: int | None, hi: int | None, limit: int
) -> list[dict[str, Any]]:
    """The run's events in step order (then arrival order), of `kind` and within steps [lo, hi] where given,
    at most `limit`, in their light form (`event_light`): only small details leave the database, a list of
    big events costs their summaries."""
    small = EventRow.details_bytes <= INLINE_DETAIL_BYTES
    query = select(
        EventRow.id,
        EventRow.run_id,
        EventRow.kind,
        EventRow.step,
        EventRow.created_at,
        EventRow.details_bytes,
        EventRow.summary,
        case((small, EventRow.details), else_=null()).label("details"),
    ).where(EventRow.run_id == run_id)
    if kind is not None:
        query = query.where(EventRow.kind == kind)
    if lo is not None:
        query = query.where(EventRow.step >= lo)
    if hi is not None:
        query = query.where(EventRow.step <= hi)
    rows = session.execute(query.order_by(EventRow.step, EventRow.id).limit(limit)).mappings()
    return [event_light({**row, "created_at": as_utc(row["created_at"])}) for row in rows]


def event_of_run(session: Session, *, run_id: int, event_id: int) -> EventRow | None:
    """One event of the run (None: the run has no such event)."""
    event = session.get(EventRow, event_id)
    return event if event is not None and event.run_id == run_id else None
