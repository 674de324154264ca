"""The publishing side of the alert service (`monitor_server.services.alerting`): alerts and incidents onto
the event stream after their transaction commits, one webhook message per claimed incident (built when it
is sent, after the notifier's settle delay), and stream events read back from their rows for another
server instance (`monitor_server.infra.events_pg`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from monitor_server.core.db import Database
from monitor_server.infra.events import EventBroker
from monitor_server.services import commands as command_ops
from monitor_server.services.alert_records import alert_public
from monitor_server.services.client_events import event_light
from monitor_server.storage.models import Alert, Command, EventRow, Incident, Run, as_utc
from monitor_server.storage.run_meta import RunMetaCache

#: a webhook message, built when it is sent (None: its incident is gone)
MessageBuilder = Callable[[], dict[str, Any] | None]
#: incidents as the API returns them: (session, run id, incidents) -> their public dicts
IncidentsPublic = Callable[[Session, int, Sequence[Incident]], list[dict[str, Any]]]


class Notifier(Protocol):
    """Where webhook messages go (`monitor_server.infra.webhook.WebhookNotifier`)."""

    def submit(self, message: MessageBuilder, key: Hashable | None = None) -> None: ...

    def close(self) -> None: ...


class AlertPublisher:
    """Publishes what the alert service recorded: to the stream's subscribers and to the webhook."""

    def __init__(
        self,
        *,
        db: Database,
        broker: EventBroker,
        run_meta: RunMetaCache,
        incidents_public: IncidentsPublic,
        notifier: Notifier | None,
    ) -> None:
        self.db = db
        self.broker = broker
        self.run_meta = run_meta
        self.incidents_public = incidents_public
        self.notifier = notifier

    def publish(
        self,
        run_id: int,
        alerts_out: list[dict[str, Any]],
        incidents_out: list[dict[str, Any]],
        notify: list[int],
    ) -> None:
        """After the commit: alerts and incidents to the stream, claimed incidents to the webhook."""
        # one publication per kind: a NaN in 1,500 tensors is one hop onto the event loop, not 1,500
        self.broker.publish_many(run_id, "alert", alerts_out)
        self.broker.publish_many(run_id, "incident", incidents_out)
        notifier = self.notifier
        if notifier is not None:
            for incident_id in notify:
                notifier.submit(self.message(run_id, incident_id), key=run_id)

    def message(self, run_id: int, incident_id: int) -> MessageBuilder:
        """The webhook message of an incident, built when it is sent (after the settle delay)."""

        def build() -> dict[str, Any] | None:
            with self.db.read_session() as session:
                incident = session.get(Incident, incident_id)
                run_name = session.scalar(select(Run.name).where(Run.id == run_id))
                if incident is None:
                    return None
                public = self.incidents_public(session, run_id, [incident])[0]
            root = public["root"] or {}
            return {
                "incident_id": incident_id,
                "kind": public["kind"],
                "severity": public["severity"],
                "run_id": run_id,
                "run_name": run_name,
                "tensor_name": root.get("tensor_name"),
                "step": root.get("onset_step", public["first_step"]),
                "message": f"{public['title']}: {root.get('message', '')}",
                "affected": public["tensors"],
                "alert_count": public["alert_count"],
                "url": public["url"],
            }

        return build

    def event_data(self, run_id: int, name: str, row_id: int) -> dict[str, Any] | None:
        """The data of a stream event read back from its row (an event another server instance sent by
        reference, `monitor_server.infra.events_pg`): an alert, incident, command or client event (light,
        as the stream carries it; its dates are encoded with it, `Event.encode`); None when gone."""
        model = {"alert": Alert, "incident": Incident, "command": Command, "event": EventRow}.get(name)
        if model is None:
            return None
        with self.db.read_session() as session:
            row = session.get(model, row_id)
            if not isinstance(row, Alert | Incident | Command | EventRow) or row.run_id != run_id:
                return None
            if isinstance(row, EventRow):
                fields = ("id", "run_id", "kind", "step", "details", "summary", "details_bytes", "created_at")
                event = {f: getattr(row, f) for f in fields}
                data = event_light({**event, "created_at": as_utc(row.created_at)})
            elif isinstance(row, Alert):
                data = alert_public(row, self.run_meta.get(session, run_id))
            elif isinstance(row, Incident):
                data = self.incidents_public(session, run_id, [row])[0]
            else:
                data = command_ops.command_public(row)
        return data

    def close(self) -> None:
        """Stop the webhook notifier."""
        if self.notifier is not None:
            self.notifier.close()
