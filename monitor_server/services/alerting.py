"""The alert service: runs the detectors on each ingested batch and records what they find as alerts,
grouped into incidents (`monitor_server.services.incidents`); stalled runs, the webhook and the alert /
incident events of the stream.

It is split on three seams, and `AlertService` joins them:

- detection, `monitor_server.services.detector_cache`: the engines of the runs used last, rebuilt from
  the state checkpointed in `runs.detector_state` (running the steps stored since again) after a restart,
  after eviction, or when another server instance sharing the database has run the detectors since;
- persistence, `monitor_server.services.alert_records`: findings folded into alerts and incidents, each
  incident's webhook message claimed once (``UPDATE ... WHERE notified_at IS NULL``);
- publishing, `monitor_server.services.alert_publishing`: the stream and the webhook, after the commit.

A batch is evaluated inside one write transaction that holds the run's row lock (`SELECT ... FOR UPDATE`;
on SQLite the database's write lock): the state is read, advanced and (every few batches,
`CHECKPOINT_BATCHES`) written back, and the alerts stored, by one instance at a time. The stall check is a
job one instance at a time runs (`Database.exclusive_job`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from fp8_protocol.codec import jsonable
from monitor_server.core.config import Settings
from monitor_server.core.db import Database
from monitor_server.detectors.engine import DetectorConfig, DetectorEngine, check_stalled
from monitor_server.detectors.types import Finding, StepBatch
from monitor_server.infra.events import EventBroker
from monitor_server.services import alert_records as records
from monitor_server.services.alert_publishing import AlertPublisher, Notifier
from monitor_server.services.detector_cache import CHECKPOINT_VERSION_KEY, EngineCache
from monitor_server.services.incidents import TensorOrder, assign_incidents
from monitor_server.storage.models import Incident, Run, as_utc, utcnow
from monitor_server.storage.run_meta import RunMeta, RunMetaCache

log = logging.getLogger("fp8scope.monitor")

#: `Database.exclusive_job` number of the stall check
STALL_CHECK_JOB = 1
#: `Database.exclusive_job` number of the runs' maintenance (close abandoned runs, retention)
MAINTENANCE_JOB = 2
#: batches of one run kept for a retry of the detectors (the oldest go beyond it: a database that fails
#: for that long has lost those alerts, and says so in the log)
MAX_PENDING_BATCHES = 64

#: a batch of stored steps and the client events that came with it
Work = list[tuple[StepBatch, list[dict[str, Any]]]]
#: what one transaction recorded: the public alerts and incidents, and the incidents whose webhook
#: message it claimed
Recorded = tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]


def _notifier(settings: Settings) -> Notifier | None:
    if not settings.webhook_url:
        return None
    from monitor_server.infra.webhook import WebhookNotifier

    return WebhookNotifier(
        settings.webhook_url,
        min_interval_s=settings.webhook_min_interval_seconds,
        settle_s=settings.webhook_settle_seconds,
    )


class AlertService:
    """Runs the detector engine for each run and turns its findings into alerts and incidents; sends one
    webhook message per incident (rate-limited per run)."""

    def __init__(self, settings: Settings, db: Database, broker: EventBroker, run_meta: RunMetaCache):
        self.settings = settings
        self.db = db
        self.run_meta = run_meta
        self._config: DetectorConfig = settings.detector_config
        self.engines = EngineCache(self._config, run_meta, max_runs=settings.cache_runs)
        self.publisher = AlertPublisher(
            db=db,
            broker=broker,
            run_meta=run_meta,
            incidents_public=self.incidents_public,
            notifier=_notifier(settings),
        )
        # per run, batches stored whose findings could not be (see `after_ingest`)
        self._pending: dict[int, Work] = {}

    # -- what the routes and the app reach ----------------------------------------------------------
    @property
    def notifier(self) -> Notifier | None:
        """Where webhook messages go (None without a webhook URL)."""
        return self.publisher.notifier

    @notifier.setter
    def notifier(self, notifier: Notifier | None) -> None:
        self.publisher.notifier = notifier

    @property
    def checkpoint_every(self) -> tuple[int, int, float]:
        """When a run's detector state is written back: (batches, steps, seconds) since it last was."""
        return self.engines.checkpoint_every

    @checkpoint_every.setter
    def checkpoint_every(self, every: tuple[int, int, float]) -> None:
        self.engines.checkpoint_every = every

    @property
    def cached_runs(self) -> int:
        """Runs whose detector engine is held in memory."""
        return len(self.engines)

    def detector_config(self) -> DetectorConfig:
        """The engine's DetectorConfig built from the `detectors` setting (checked when the settings were
        built, so this does not fail)."""
        return self._config

    def engine_for(self, session: Session, run_id: int) -> DetectorEngine | None:
        """The engine of a run as its persisted state stands (`EngineCache.engine_for`)."""
        return self.engines.engine_for(session, run_id)

    def tensor_order(self, meta: RunMeta | None) -> TensorOrder:
        """The run's forward-then-backward positions (cached with its meta)."""
        return self.engines.tensor_order(meta)

    def incidents_public(
        self, session: Session, run_id: int, incidents: Sequence[Incident]
    ) -> list[dict[str, Any]]:
        """Incidents as the API returns them (alerts root cause first, link under the public URL)."""
        meta = self.run_meta.get(session, run_id)
        return records.incidents_public(
            session,
            incidents,
            run_id=run_id,
            meta=meta,
            order=self.tensor_order(meta),
            public_url=self.settings.public_url,
            window=self._config.incident_window_steps,
        )

    def event_data(self, run_id: int, name: str, row_id: int) -> dict[str, Any] | None:
        """A stream event read back from its row (`AlertPublisher.event_data`)."""
        return self.publisher.event_data(run_id, name, row_id)

    def flush(self, run_id: int) -> bool:
        """Write back a cached engine's state if it has batches not written yet (`EngineCache.flush`)."""
        return self.engines.flush(self.db, run_id)

    def retire(self, run_id: int) -> None:
        """A run that finished: write back its engine's state, then drop it from the cache."""
        self.flush(run_id)
        self.forget(run_id)

    def forget(self, run_id: int) -> None:
        """Drop a cached engine (it is rebuilt from the persisted state on next use)."""
        self.engines.forget(run_id)

    def layer_health(
        self, session: Session, run_id: int, open_alerts: list[dict[str, Any]]
    ) -> list[dict[str, Any]] | None:
        """The engine's ranked per-layer health, or None when the run has no tensors."""
        with self.db.run_lock(run_id):
            engine = self.engine_for(session, run_id)
            if engine is None:
                return None
            health: list[dict[str, Any]] = jsonable(engine.layer_health(open_alerts))
            return health

    def close(self) -> None:
        """Write back the cached engines' states; stop the webhook notifier."""
        for run_id in self.engines.runs():
            self.flush(run_id)
        self.publisher.close()

    # -- ingest hook ----------------------------------------------------------------------------------
    def after_ingest(
        self, run_id: int, batch: StepBatch, events: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Run the engine on newly stored steps and client events; store, publish and notify alerts.

        The caller holds the run's lock (`Database.run_lock`: on PostgreSQL across the server instances), so
        batches reach the engine in the order they were stored.
        Returns the alerts created or updated. When storing the findings fails (the batch itself is
        stored), the batch is kept and the engine dropped: the next batch of the run first runs the kept
        ones again, from the state persisted before them, so their alerts come late but are not lost.
        """
        with self.engines.lock:
            work = [*self._pending.pop(run_id, []), (batch, events)]
        try:
            return self._detect(run_id, work)
        except Exception:
            self.forget(run_id)  # its state is ahead of what was stored
            if len(work) > MAX_PENDING_BATCHES:
                log.error(
                    "run %s: detectors failed on %d batches in a row; the oldest one's alerts are lost",
                    run_id,
                    len(work),
                )
            with self.engines.lock:
                self._pending[run_id] = work[-MAX_PENDING_BATCHES:]
            raise

    def _detect(self, run_id: int, work: Work) -> list[dict[str, Any]]:
        if not any(len(batch.steps) or events for batch, events in work):
            return []
        # one transaction holding the run's row lock: the state read, advanced by this batch and written
        # back (every few batches: CHECKPOINT_BATCHES), with the alerts it raised, by one server instance at
        # a time
        first = min((int(batch.steps[0]) for batch, _ in work if len(batch.steps)), default=None)
        with self.db.write() as session:
            replay_to = None if first is None else first - 1
            found = self.engines.engine(session, run_id, lock=True, replay_to=replay_to)
            if found is None:
                return []
            engine, version = found
            findings: list[Finding] = []
            for batch, events in work:
                if len(batch.steps):
                    findings.extend(engine.process(batch))
                if events:
                    findings.extend(engine.process_events(events))
            save = self.engines.checkpoint_due(run_id)
            values: dict[str, Any] = {"detector_version": Run.detector_version + 1}
            if save:  # already JSON-able (non-finite floats as strings)
                values["detector_state"] = {**engine.state_dict(), CHECKPOINT_VERSION_KEY: version + 1}
            session.execute(update(Run).where(Run.id == run_id).values(**values))
            alerts_out, incidents_out, notify = self._record(session, run_id, findings)
        self.engines.advanced(run_id, engine, version + 1, save)
        self.publisher.publish(run_id, alerts_out, incidents_out, notify)
        return alerts_out

    def _record(self, session: Session, run_id: int, findings: list[Finding]) -> Recorded:
        """Store findings as alerts and incidents in `session`; claim the webhook message of each incident
        that first deserves one. Returns the public alerts and incidents and the claimed incident ids."""
        now = utcnow()
        changed = records.store_findings(session, run_id=run_id, findings=findings)
        meta = self.run_meta.get(session, run_id)
        window = self._config.incident_window_steps
        order = self.tensor_order(meta)
        incidents = assign_incidents(
            session, run_id=run_id, touched=changed, order=order, window=window, now=now
        )
        notify: list[int] = []
        if self.notifier is not None:
            floor = self.settings.webhook_min_severity
            notify = records.claim_notifications(session, incidents, min_severity=floor, now=now)
        alerts_out = [records.alert_public(a, meta) for a, _ in changed]
        return alerts_out, self.incidents_public(session, run_id, incidents), notify

    # -- periodic -------------------------------------------------------------------------------------
    def check_stalled_runs(self, now: datetime | None = None) -> int:
        """Raise `stalled` alerts for running runs without recent telemetry; returns how many findings.

        A stall already alerted (same last step, same or higher severity) is not counted again on every
        check: the alert's count says how many separate stalls (or escalations) were seen. Server
        instances sharing a PostgreSQL database take turns (one sweep at a time; an instance that finds
        another sweeping skips the round), and each stall is checked again under the run's lock before
        it is stored.
        """
        with self.db.exclusive_job(STALL_CHECK_JOB) as mine:
            return self._check_stalled_runs(now or utcnow()) if mine else 0

    def _check_stalled_runs(self, now: datetime) -> int:
        config = self.detector_config()
        with self.db.read_session() as session:
            runs = records.running_runs(session)
            alerted = records.open_stalls(session)
        count = 0
        for run_id, last_at, created_at, last_step in runs:
            finding = check_stalled(as_utc(last_at or created_at), now, config, last_step=last_step)
            if finding is None or records.stall_known(alerted.get(run_id), finding):
                continue
            with self.db.run_lock(run_id), self.db.write() as session:
                if records.stall_seen(session, run_id=run_id, finding=finding):
                    continue  # stored meanwhile (by another instance), or the run ended
                published = self._record(session, run_id, [finding])
            self.publisher.publish(run_id, *published)
            count += 1
        return count
