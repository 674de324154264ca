"""The alert service: runs the detectors on each ingested batch and records what they find as alerts,
grouped into incidents (`monitor_server.incidents`); stalled runs, the webhook and the alert / incident
events of the stream.

The detectors themselves live in `monitor_server.detectors` (the engine in `detectors/engine.py`). Engines
are cached per run and rebuilt from the state checkpointed in `runs.detector_state` after a restart, after
eviction, or when `runs.detector_version` (bumped by every batch) says another server instance sharing the
database has run the detectors since; a rebuilt engine runs the steps stored after its checkpoint again
(`monitor_server.detector_replay`). A batch is evaluated inside one write transaction that holds the run's
row lock (`SELECT ... FOR UPDATE`; on SQLite the database's write lock): the state is read, advanced and
(every few batches, `CHECKPOINT_BATCHES`) written back, and the alerts stored, by one instance at a time.
Each incident's webhook message is claimed with an atomic ``UPDATE ... WHERE notified_at IS NULL``, so it
is sent once whichever instance raised it; the stall check is a job one instance at a time runs
(`Database.exclusive_job`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from fp8_protocol.codec import jsonable
from monitor_server import commands as command_ops
from monitor_server import replays
from monitor_server.client_events import event_light
from monitor_server.core.config import Settings
from monitor_server.core.db import Database
from monitor_server.detector_replay import stored_batches
from monitor_server.detectors.engine import DetectorConfig, DetectorEngine, check_stalled
from monitor_server.detectors.types import Finding, StepBatch
from monitor_server.events import EventBroker
from monitor_server.incidents import (
    SEVERITY_RANK,
    TensorOrder,
    alert_summary,
    alerts_by_incident,
    assign_incidents,
    incident_public,
    worse,
)
from monitor_server.models import Alert, Command, EventRow, Incident, Run, as_utc, utcnow
from monitor_server.run_meta import RunMeta, RunMetaCache
from monitor_server.wire import iso_dates

log = logging.getLogger("fp8scope.monitor")


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


def store_findings(session: Session, run_id: int, findings: list[Finding]) -> list[tuple[Alert, bool]]:
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


#: `Database.exclusive_job` number of the stall check
STALL_CHECK_JOB = 1
#: `Database.exclusive_job` number of the runs' maintenance (close abandoned runs, retention)
MAINTENANCE_JOB = 2


@dataclass
class _CachedEngine:
    """A run's engine, the `detector_version` it stands at, its recipe, and what of it is not written back:
    batches and steps processed, and the time, since its last checkpoint (`AlertService._detect`)."""

    engine: DetectorEngine
    version: int
    recipe: dict[str, Any]
    unsaved_batches: int = 0
    saved_step: int | None = None
    saved_at: float = 0.0

    def checkpoint_due(self, now: float, every: tuple[int, int, float]) -> bool:
        """Whether its state should be written back with the batch it just processed; `every`: (batches,
        steps, seconds) since the last write, that batch included."""
        batches, steps, seconds = every
        step = self.engine.last_step
        return (
            self.unsaved_batches + 1 >= batches
            or now - self.saved_at >= seconds
            or (step is not None and (self.saved_step is None or step - self.saved_step >= steps))
        )


#: A run's detector state is written back (checkpointed) once this many batches, steps or seconds have
#: gone by since it last was; `detector_version` is bumped after every batch. An engine restored from an
#: older checkpoint runs the steps stored since again (`monitor_server.detector_replay`). A 512-tensor state
#: is ~0.5 MB: written after every batch, it was the largest single cost of ingesting a one-step batch.
CHECKPOINT_BATCHES = 16
CHECKPOINT_STEPS = 32
CHECKPOINT_SECONDS = 10.0
#: the key of a checkpoint that holds the `detector_version` it was written at (a state without it was
#: written after every batch, by an older version of this code: it is current)
CHECKPOINT_VERSION_KEY = "checkpoint_version"


#: batches of one run kept for a retry of the detectors (the oldest go beyond it: a database that fails
#: for that long has lost those alerts, and says so in the log)
MAX_PENDING_BATCHES = 64


class AlertService:
    """Runs the detector engine for each run and turns its findings into alerts and incidents; sends one
    webhook message per incident (rate-limited per run)."""

    def __init__(self, settings: Settings, db: Database, broker: EventBroker, run_meta: RunMetaCache):
        self.settings = settings
        self.db = db
        self.broker = broker
        self.run_meta = run_meta
        self._config: DetectorConfig = settings.detector_config
        # engines of the runs used last (each holds per-tensor state, ~1 KB per tensor); an evicted one is
        # rebuilt from the last checkpoint and
        # the steps stored since
        self._engines: OrderedDict[int, _CachedEngine] = OrderedDict()
        self._engines_lock = threading.Lock()
        self.max_runs = settings.cache_runs
        #: when a run's detector state is written back: (batches, steps, seconds) since it last was
        self.checkpoint_every: tuple[int, int, float] = (
            CHECKPOINT_BATCHES,
            CHECKPOINT_STEPS,
            CHECKPOINT_SECONDS,
        )
        # per run, batches stored whose findings could not be (see `after_ingest`)
        self._pending: dict[int, list[tuple[StepBatch, list[dict[str, Any]]]]] = {}
        self._orders: dict[int, tuple[RunMeta, TensorOrder]] = {}
        self.notifier: Any = None
        if settings.webhook_url:
            from monitor_server.webhook import WebhookNotifier

            self.notifier = WebhookNotifier(
                settings.webhook_url,
                min_interval_s=settings.webhook_min_interval_seconds,
                settle_s=settings.webhook_settle_seconds,
            )

    # -- engine ----------------------------------------------------------------------------------------
    def detector_config(self) -> DetectorConfig:
        """The engine's DetectorConfig built from the `detectors` setting (checked when the settings were
        built, so this does not fail)."""
        return self._config

    def engine_for(self, session: Session, run_id: int) -> DetectorEngine | None:
        """The engine of a run as its persisted state stands: the cached one when it was built from the
        current `detector_version` and recipe, else one built from the state; None for no run."""
        found = self._engine(session, run_id, lock=False)
        return None if found is None else found[0]

    def _engine(
        self, session: Session, run_id: int, *, lock: bool, replay_to: int | None = None
    ) -> tuple[DetectorEngine, int] | None:
        """`engine_for` and the version it stands at; `lock` takes the run's row lock while reading (the
        caller advances the state and writes it back in the same transaction). An engine restored from a
        checkpoint older than the run's `detector_version` runs the steps stored since again, up to
        `replay_to` (default: the run's last step; a caller about to process stored steps stops before
        them)."""
        query = select(Run.detector_version, Run.recipe, Run.recipe_overrides, Run.last_step).where(
            Run.id == run_id
        )
        row = session.execute(query.with_for_update() if lock else query).first()
        if row is None:
            return None
        version, base, overrides, last_step = row
        effective = command_ops.effective_recipe(Run(recipe=base, recipe_overrides=overrides))
        recipe = {**effective["model"], "overrides": (overrides or {}).get("layers", {})}
        with self._engines_lock:
            cached = self._engines.get(run_id)
            if cached is not None and cached.version == version:
                if cached.recipe != recipe:  # a recipe change was applied: the database's recipe is the truth
                    cached.engine.set_recipe(recipe)
                    cached.recipe = recipe
                self._engines.move_to_end(run_id)
                return cached.engine, version
        meta = self.run_meta.get(session, run_id)
        if meta is None:
            return None
        state = session.scalar(select(Run.detector_state).where(Run.id == run_id))
        saved_version = version
        if isinstance(state, dict) and CHECKPOINT_VERSION_KEY in state:
            state = dict(state)
            saved_version = state.pop(CHECKPOINT_VERSION_KEY)
        try:
            engine = DetectorEngine(self.detector_config(), list(meta.tensors), recipe, state)
        except ValueError:
            log.exception("run %s: persisted detector state unusable; starting afresh", run_id)
            engine = DetectorEngine(self.detector_config(), list(meta.tensors), recipe, None)
            saved_version = -1
        # the database's recipe (with every applied command) is the truth, also over a restored state
        engine.set_recipe(recipe)
        entry = _CachedEngine(engine, version, recipe, saved_step=engine.last_step, saved_at=time.monotonic())
        if saved_version != version:  # behind the batches processed since the checkpoint
            upto = last_step if replay_to is None or last_step is None else min(last_step, replay_to)
            if upto is not None:
                for batch in stored_batches(session, run_id, engine.last_step, upto, len(meta.tensors)):
                    engine.process(batch)  # findings dropped: recorded when these steps first came
            entry.saved_step, entry.unsaved_batches = None, self.checkpoint_every[0]  # write it back soon
        with self._engines_lock:
            self._engines[run_id] = entry
            self._engines.move_to_end(run_id)
            while len(self._engines) > self.max_runs:
                evicted, _ = self._engines.popitem(last=False)
                self._orders.pop(evicted, None)
        return engine, version

    def _advanced(self, run_id: int, engine: DetectorEngine, version: int, saved: bool) -> None:
        # the engine processed a batch now recorded as `version`: it stays the cached one (unless dropped
        # meanwhile); `saved`: its state was written back with it
        with self._engines_lock:
            cached = self._engines.get(run_id)
            if cached is not None and cached.engine is engine:
                cached.version = version
                if saved:
                    cached.unsaved_batches, cached.saved_step = 0, engine.last_step
                    cached.saved_at = time.monotonic()
                else:
                    cached.unsaved_batches += 1

    def tensor_order(self, meta: RunMeta | None) -> TensorOrder:
        """The run's forward-then-backward positions (cached with its meta)."""
        if meta is None:
            return TensorOrder.of(None)
        cached = self._orders.get(meta.run_id)
        if cached is None or cached[0] is not meta:
            cached = (meta, TensorOrder.of(meta))
            self._orders[meta.run_id] = cached
        return cached[1]

    def incidents_public(
        self, session: Session, run_id: int, incidents: list[Incident]
    ) -> list[dict[str, Any]]:
        """Incidents as the API returns them (alerts root cause first, link under the public URL)."""
        meta = self.run_meta.get(session, run_id)
        order = self.tensor_order(meta)
        alerts = alerts_by_incident(session, [i.id for i in incidents])
        url = self.settings.public_url
        out = [incident_public(i, alerts[i.id], meta, order, url) for i in incidents]
        replays.annotate(session, run_id, incidents, out, self._config.incident_window_steps)
        return out

    def flush(self, run_id: int) -> bool:
        """Write back a cached engine's state if it has batches not written yet (and still stands at the
        run's `detector_version`); True if it wrote. Never raises: a failed write only means a longer replay
        on the next use."""
        with self._engines_lock:
            cached = self._engines.get(run_id)
        if cached is None or not cached.unsaved_batches:
            return False
        try:
            with self.db.run_lock(run_id), self.db.write() as session:
                query = select(Run.detector_version).where(Run.id == run_id).with_for_update()
                if session.scalar(query) != cached.version:
                    return False
                state = {**cached.engine.state_dict(), CHECKPOINT_VERSION_KEY: cached.version}
                session.execute(update(Run).where(Run.id == run_id).values(detector_state=state))
        except Exception:
            log.warning("run %s: writing back the detector state failed", run_id, exc_info=True)
            return False
        self._advanced(run_id, cached.engine, cached.version, True)
        return True

    def retire(self, run_id: int) -> None:
        """A run that finished: write back its engine's state, then drop it from the cache."""
        self.flush(run_id)
        self.forget(run_id)

    def forget(self, run_id: int) -> None:
        """Drop a cached engine (it is rebuilt from the persisted state on next use)."""
        with self._engines_lock:
            self._engines.pop(run_id, None)
            self._orders.pop(run_id, None)

    @property
    def cached_runs(self) -> int:
        """Runs whose detector engine is held in memory."""
        return len(self._engines)

    # -- ingest hook ------------------------------------------------------------------------------------
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
        with self._engines_lock:
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
            with self._engines_lock:
                self._pending[run_id] = work[-MAX_PENDING_BATCHES:]
            raise

    def _detect(
        self, run_id: int, work: list[tuple[StepBatch, list[dict[str, Any]]]]
    ) -> list[dict[str, Any]]:
        if not any(len(batch.steps) or events for batch, events in work):
            return []
        # one transaction holding the run's row lock: the state read, advanced by this batch and written
        # back (every few batches: CHECKPOINT_BATCHES), with the alerts it raised, by one server instance at
        # a time
        first = min((int(batch.steps[0]) for batch, _ in work if len(batch.steps)), default=None)
        with self.db.write() as session:
            found = self._engine(session, run_id, lock=True, replay_to=None if first is None else first - 1)
            if found is None:
                return []
            engine, version = found
            findings: list[Finding] = []
            for batch, events in work:
                if len(batch.steps):
                    findings.extend(engine.process(batch))
                if events:
                    findings.extend(engine.process_events(events))
            with self._engines_lock:
                cached = self._engines.get(run_id)
            save = cached is None or cached.checkpoint_due(time.monotonic(), self.checkpoint_every)
            values: dict[str, Any] = {"detector_version": Run.detector_version + 1}
            if save:  # already JSON-able (non-finite floats as strings)
                values["detector_state"] = {**engine.state_dict(), CHECKPOINT_VERSION_KEY: version + 1}
            session.execute(update(Run).where(Run.id == run_id).values(**values))
            published = self._record(session, run_id, findings)
        self._advanced(run_id, engine, version + 1, save)
        return self._publish(run_id, *published)

    def _record(
        self, session: Session, run_id: int, findings: list[Finding]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
        """Store findings as alerts and incidents in `session`; claim the webhook message of each incident
        that first deserves one. Returns the public alerts and incidents and the claimed incident ids."""
        now = utcnow()
        notify: list[int] = []
        changed = store_findings(session, run_id, findings)
        meta = self.run_meta.get(session, run_id)
        incidents = assign_incidents(
            session, run_id, changed, self.tensor_order(meta), self._config.incident_window_steps, now
        )
        floor = SEVERITY_RANK[self.settings.webhook_min_severity]
        for incident in incidents if self.notifier is not None else ():
            if incident.notified_at is None and SEVERITY_RANK.get(incident.severity, 0) >= floor:
                # one message per incident, when it first deserves one: whichever transaction sets
                # notified_at first sends it (another instance may have raced this one to it)
                claimed = session.execute(
                    update(Incident)
                    .where(Incident.id == incident.id, Incident.notified_at.is_(None))
                    .values(notified_at=now)
                    .execution_options(synchronize_session=False)
                )
                if claimed.rowcount == 1:
                    set_committed_value(incident, "notified_at", now)
                    notify.append(incident.id)
        alerts_out = [alert_public(a, meta) for a, _ in changed]
        incidents_out = self.incidents_public(session, run_id, incidents)
        return alerts_out, incidents_out, notify

    def _publish(
        self,
        run_id: int,
        alerts_out: list[dict[str, Any]],
        incidents_out: list[dict[str, Any]],
        notify: list[int],
    ) -> list[dict[str, Any]]:
        """After the commit: alerts and incidents to the stream, claimed incidents to the webhook."""
        # one publication per kind: a NaN in 1,500 tensors is one hop onto the event loop, not 1,500
        self.broker.publish_many(run_id, "alert", [iso_dates(public) for public in alerts_out])
        self.broker.publish_many(run_id, "incident", [iso_dates(public) for public in incidents_out])
        for incident_id in notify:
            self.notifier.submit(self._message(run_id, incident_id), key=run_id)
        return alerts_out

    def _message(self, run_id: int, incident_id: int) -> Any:
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

    # -- periodic ---------------------------------------------------------------------------------------
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
        rank = SEVERITY_RANK
        with self.db.read_session() as session:
            runs = session.execute(
                select(Run.id, Run.last_telemetry_at, Run.created_at, Run.last_step).where(
                    Run.status == "running"
                )
            ).all()
            alerted = {
                run_id: (last_step, severity)
                for run_id, last_step, severity in session.execute(
                    select(Alert.run_id, Alert.last_step, Alert.severity).where(
                        Alert.kind == "stalled", Alert.state == "open"
                    )
                )
            }
        count = 0
        for run_id, last_at, created_at, last_step in runs:
            finding = check_stalled(as_utc(last_at or created_at), now, config, last_step=last_step)
            if finding is None:
                continue
            seen = alerted.get(run_id)
            if seen is not None and seen[0] == finding.step and rank[seen[1]] >= rank[finding.severity]:
                continue
            with self.db.run_lock(run_id), self.db.write() as session:
                if self._stall_seen(session, run_id, finding):
                    continue  # stored meanwhile (by another instance), or the run ended
                published = self._record(session, run_id, [finding])
            self._publish(run_id, *published)
            count += 1
        return count

    @staticmethod
    def _stall_seen(session: Session, run_id: int, finding: Finding) -> bool:
        """Whether the run's open `stalled` alert already says this (same step, same or worse severity),
        or the run is no longer running; read under the run's row lock."""
        status = session.scalar(select(Run.status).where(Run.id == run_id).with_for_update())
        if status != "running":
            return True
        seen = session.execute(
            select(Alert.last_step, Alert.severity).where(
                Alert.run_id == run_id, Alert.kind == "stalled", Alert.state == "open"
            )
        ).first()
        rank = SEVERITY_RANK
        return seen is not None and seen[0] == finding.step and rank[seen[1]] >= rank[finding.severity]

    def layer_health(
        self, session: Session, run_id: int, open_alerts: list[dict[str, Any]]
    ) -> list[dict] | None:
        """The engine's ranked per-layer health, or None when the run has no tensors."""
        with self.db.run_lock(run_id):
            engine = self.engine_for(session, run_id)
            if engine is None:
                return None
            return jsonable(engine.layer_health(open_alerts))

    def event_data(self, run_id: int, name: str, row_id: int) -> dict[str, Any] | None:
        """The data of a stream event read back from its row (an event another server instance sent by
        reference, `monitor_server.events_pg`): an alert, incident, command or client event (light, as
        the stream carries it); None when gone."""
        model = {"alert": Alert, "incident": Incident, "command": Command, "event": EventRow}.get(name)
        if model is None:
            return None
        with self.db.read_session() as session:
            row = session.get(model, row_id)
            if row is None or row.run_id != run_id:
                return None
            if isinstance(row, EventRow):
                fields = ("id", "run_id", "kind", "step", "details", "summary", "details_bytes", "created_at")
                event = {f: getattr(row, f) for f in fields}
                return iso_dates(event_light({**event, "created_at": as_utc(row.created_at)}))
            if isinstance(row, Alert):
                return iso_dates(alert_public(row, self.run_meta.get(session, run_id)))
            if isinstance(row, Incident):
                return iso_dates(self.incidents_public(session, run_id, [row])[0])
            return iso_dates(command_ops.command_public(row))

    def close(self) -> None:
        """Write back the cached engines' states; stop the webhook notifier."""
        with self._engines_lock:
            runs = list(self._engines)
        for run_id in runs:
            self.flush(run_id)
        if self.notifier is not None:
            self.notifier.close()
