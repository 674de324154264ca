"""Client events (loss spikes, non-finite values, rank amaxes, custom) as the API shows them: light in
lists and on the stream, whole one at a time."""

from __future__ import annotations

from typing import Any

from monitor_server.models import EventRow, as_utc
from monitor_server.schemas import EventPublic, attributes
from monitor_server.wire import details_summary

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
