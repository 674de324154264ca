"""Everything one app instance owns: settings, database, event broker, metrics, caches, alert service."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select

from fp8_protocol.codec import NONFINITE_SPELLING
from monitor_server.core.config import Settings
from monitor_server.core.db import Database
from monitor_server.infra.events import EventBroker
from monitor_server.infra.metrics import Metrics
from monitor_server.services import run_admin
from monitor_server.services.alerting import AlertService
from monitor_server.storage.models import Alert, Run
from monitor_server.storage.run_meta import RunMetaCache

#: runs reported in /metrics gauges (newest first)
METRICS_MAX_RUNS = 200


@dataclass
class AppContext:
    """The state shared by the routes of one app (``app.state.ctx``)."""

    settings: Settings
    db: Database
    broker: EventBroker
    metrics: Metrics
    run_meta: RunMetaCache
    #: the detectors and the alerts they raise (`monitor_server.services.alerting`)
    detection: AlertService
    #: bounds concurrent telemetry decoding; made on first use, on the event loop
    decode_slots: asyncio.Semaphore | None = field(default=None, repr=False)
    #: per run, the telemetry requests storing or waiting to store (on the event loop): a run's batches
    #: wait their turn there, holding no worker thread (`monitor_server.api.routes.telemetry.run_turn`)
    run_turns: dict[int, tuple[asyncio.Lock, int]] = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, settings: Settings) -> AppContext:
        """Build the context (the database schema is migrated separately, at startup)."""
        db = Database(settings.db_url, settings.run_lock_wait_seconds, settings.run_lock_lease_seconds)
        broker = EventBroker(
            settings.sse_queue_bytes, settings.sse_total_bytes, settings.sse_streams_per_token
        )
        run_meta = RunMetaCache(settings.cache_runs)
        ctx = cls(settings, db, broker, Metrics(), run_meta, AlertService(settings, db, broker, run_meta))
        ctx.metrics.attach_database(ctx.metrics_snapshot)
        ctx.metrics.attach_caches(lambda: {"meta": len(run_meta), "detectors": ctx.detection.cached_runs})
        return ctx

    def forget_run(self, run_id: int) -> None:
        """Drop the caches of a deleted run."""
        self.run_meta.forget(run_id)
        self.detection.forget(run_id)

    def maintain(self, now: datetime) -> None:
        """One round of the runs' periodic upkeep (`monitor_server.services.run_admin.maintain`)."""
        run_admin.maintain(
            db=self.db,
            settings=self.settings,
            detection=self.detection,
            broker=self.broker,
            forget_run=self.forget_run,
            now=now,
        )

    def metrics_snapshot(self) -> tuple[dict[str, int], list[tuple[int, str, float | None, int | None]]]:
        """Open alerts by kind and (id, name, last loss, last step) of recent runs, for /metrics."""
        with self.db.read_session() as session:
            alerts = dict(
                session.execute(
                    select(Alert.kind, func.count()).where(Alert.state == "open").group_by(Alert.kind)
                ).all()
            )
            rows = session.execute(
                select(Run.id, Run.name, Run.last_loss, Run.last_step)
                .order_by(Run.id.desc())
                .limit(METRICS_MAX_RUNS)
            ).all()
        runs = []
        for run_id, name, loss, step in rows:
            value = NONFINITE_SPELLING.get(loss, loss)
            runs.append((run_id, name, value if isinstance(value, int | float) else None, step))
        return alerts, runs
