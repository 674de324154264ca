"""SQLAlchemy 2 models: runs, their tensors, steps, statistics, rollups, block scale histograms, alerts,
incidents, their replays and commands.

Statistics are stored as packed little-endian float64 vectors of length T (one per run, statistic and step),
never one row per tensor per step; `Rollup` holds the same vectors aggregated over aligned blocks of steps.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, overload

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


@overload
def as_utc(value: datetime) -> datetime: ...
@overload
def as_utc(value: datetime | None) -> datetime | None: ...
def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; they were written as UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


class Base(DeclarativeBase):
    """Declarative base of all tables."""


#: table option of the tables whose ids leave the database (URLs, a job's run id, cached meta): on SQLite,
#: AUTOINCREMENT, without which the id of a deleted newest row goes to the next insert (migration 0011);
#: PostgreSQL's sequences never hand out a number twice
NEVER_REUSED = {"sqlite_autoincrement": True}


def _run_fk() -> ForeignKey:
    return ForeignKey("runs.id", ondelete="CASCADE")


class Run(Base):
    """One training run."""

    __tablename__ = "runs"
    __table_args__ = (
        Index("uq_runs_client_key", "client_key", unique=True),
        Index("ix_runs_status", "status"),
        NEVER_REUSED,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    recipe: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: applied recipe changes: {"model": {key: value}, "layers": {layer: {key: value}}}
    recipe_overrides: Mapped[dict[str, Any]] = mapped_column(JSON)
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    host: Mapped[str] = mapped_column(String(200), default="")
    status: Mapped[str] = mapped_column(String(16), default="running")
    num_tensors: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    first_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: JSON so a NaN / inf loss survives SQLite (which stores a NaN REAL as NULL); wire-encoded
    last_loss: Mapped[float | str | None] = mapped_column(JSON, nullable=True)
    steps_stored: Mapped[int] = mapped_column(BigInteger, default=0)
    last_telemetry_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    detector_state: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: bumped with every write of `detector_state`: an instance whose cached engine was built from an older
    #: version (another instance has run the detectors since) rebuilds it from the state
    detector_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    #: the client's key for idempotent registration (a retried or replayed POST /runs finds this run)
    client_key: Mapped[str | None] = mapped_column(String(100), nullable=True)
    #: name of the token that registered the run (None: registered without tokens, or before owners were
    #: kept); an `ingest` token writes only to its own runs, `control` to any
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    #: the names of the scalars the run has sent (sorted), for the dashboard's chart picker
    scalar_names: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    #: free-text notes on the run, written from the dashboard (at most `schemas.MAX_NOTES` characters)
    notes: Mapped[str] = mapped_column(Text, default="", server_default="")


class RunTag(Base):
    """A tag of a run (set by the job at registration or from the dashboard)."""

    __tablename__ = "run_tags"
    __table_args__ = (Index("ix_run_tags_tag", "tag"),)

    run_id: Mapped[int] = mapped_column(_run_fk(), primary_key=True)
    tag: Mapped[str] = mapped_column(String(64), primary_key=True)


class TensorRow(Base):
    """A quantized tensor registered with a run (dense `index` 0..T-1)."""

    __tablename__ = "tensors"

    run_id: Mapped[int] = mapped_column(_run_fk(), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(300))
    layer: Mapped[str] = mapped_column(String(300))
    role: Mapped[str] = mapped_column(String(16))
    format: Mapped[str] = mapped_column(String(8))


class StepRow(Base):
    """One stored step of a run: its scalars (the loss also as a column, for fast series)."""

    __tablename__ = "steps"

    run_id: Mapped[int] = mapped_column(_run_fk(), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    #: the finite loss, for fast series; NULL when absent or non-finite (then read `scalars`)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: JSON object; non-finite values spelled "NaN" / "Infinity" / "-Infinity"
    scalars: Mapped[dict[str, Any]] = mapped_column(JSON)


class StepStat(Base):
    """One statistic of one step for all T tensors: T little-endian float32 or float64 (`stat_rows.pack`)."""

    __tablename__ = "step_stats"

    run_id: Mapped[int] = mapped_column(_run_fk(), primary_key=True)
    metric: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    values: Mapped[bytes] = mapped_column(LargeBinary)


class BlockHistogram(Base):
    """The block scale exponent histogram of one tensor: of one step (`level` 1), or summed over the aligned
    block [step, step + level) of steps: level 8 once compaction (`retention.py`) dropped the per-step rows,
    levels 64 / 512 / 4096 once the run moved past the block (`block_hist.update_histogram_sums`).
    `counts[j]` blocks had the biased exponent `lo` + j (`monitor_server.storage.block_hist.pack_counts`)."""

    __tablename__ = "block_histograms"

    run_id: Mapped[int] = mapped_column(_run_fk(), primary_key=True)
    tensor: Mapped[int] = mapped_column(Integer, primary_key=True)
    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    lo: Mapped[int] = mapped_column(SmallInteger)
    #: steps summed into the row (1 for a step's own histogram)
    n_steps: Mapped[int] = mapped_column(Integer)
    counts: Mapped[bytes] = mapped_column(LargeBinary)


class Rollup(Base):
    """A heatmap metric aggregated over the aligned block [block*level, (block+1)*level) of steps."""

    __tablename__ = "rollups"

    run_id: Mapped[int] = mapped_column(_run_fk(), primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    metric: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    block: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    values: Mapped[bytes] = mapped_column(LargeBinary)
    n_steps: Mapped[int] = mapped_column(Integer)


class IngestBatch(Base):
    """An idempotency key already seen for a run."""

    __tablename__ = "ingest_batches"

    run_id: Mapped[int] = mapped_column(_run_fk(), primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(String(200), primary_key=True)
    stored_steps: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EventRow(Base):
    """A client-reported event (loss spike, non-finite values, custom; flight-recorder context in
    `details`), stored as sent so a post-mortem can read it back."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_step", "run_id", "step"), NEVER_REUSED)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(_run_fk())
    kind: Mapped[str] = mapped_column(String(16))
    step: Mapped[int] = mapped_column(BigInteger)
    details: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    #: the top-level scalar fields of `details` (`wire.details_summary`), and the size of `details` as JSON:
    #: what lists show, so they never load details (a flight recorder can be megabytes)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    details_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Incident(Base):
    """Alerts of one run that share a cause: found within `DetectorConfig.incident_window_steps` steps.

    One dashboard entry and at most one webhook message; acknowledging it acknowledges its alerts. The root
    cause is the alert that comes first by (onset step, forward-then-backward position of its tensor, kind).
    """

    __tablename__ = "incidents"
    __table_args__ = (Index("ix_incidents_run_state", "run_id", "state"), NEVER_REUSED)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(_run_fk())
    state: Mapped[str] = mapped_column(String(16), default="open")
    #: the worst severity of its alerts
    severity: Mapped[str] = mapped_column(String(16))
    #: the root cause (an alert id of this incident; the alert rows point back through `incident_id`)
    root_alert_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    alert_count: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    #: when its webhook message was queued (None: none, e.g. no webhook, or an incident of info alerts only)
    notified_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    acknowledged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    acknowledged_by: Mapped[str | None] = mapped_column(String(200), nullable=True)


class IncidentReplay(Base):
    """The report of a replay of an incident's captured step (``fp8-train replay``): the verdict, the
    culprits and the evidence per configuration, as the job sent it (one per incident; a new one replaces
    it). See `monitor_server/services/replays.py`."""

    __tablename__ = "incident_replays"
    __table_args__ = (Index("ix_incident_replays_run", "run_id"),)

    incident_id: Mapped[int] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"), primary_key=True)
    run_id: Mapped[int] = mapped_column(_run_fk())
    verdict: Mapped[str] = mapped_column(String(32))
    report: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    #: the token that stored it ("anonymous" without tokens)
    updated_by: Mapped[str] = mapped_column(String(200))


class PolicyAction(Base):
    """What a run's remediation policy made of a replayed incident (`monitor_server/services/policies.py`): a
    recipe command it queued (or proposed, for a person to apply), and the check of the loss after it.

    ``state``: ``proposed`` (dry run: waits for a person), ``queued`` (its command is on its way to the job),
    ``kept`` (the loss after it was no worse than before), ``rolled_back`` (it was worse: a rollback command
    was queued), ``capped`` (not queued: the run's actions-per-hour cap was reached), ``ended`` (the run
    ended before the check).
    """

    __tablename__ = "policy_actions"
    __table_args__ = (Index("ix_policy_actions_run_state", "run_id", "state"), NEVER_REUSED)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(_run_fk())
    incident_id: Mapped[int | None] = mapped_column(
        ForeignKey("incidents.id", ondelete="SET NULL"), nullable=True
    )
    rule: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(300))
    changes: Mapped[dict[str, Any]] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    command_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    rollback_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    loss_before: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_after: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    checked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Alert(Base):
    """A detector finding; at most one *open* alert per (run, kind, tensor)."""

    __tablename__ = "alerts"
    __table_args__ = (
        Index(
            "uq_alerts_open",
            "run_id",
            "kind",
            "tensor_key",
            unique=True,
            sqlite_where=text("state = 'open'"),
            postgresql_where=text("state = 'open'"),
        ),
        Index("ix_alerts_run_state", "run_id", "state"),
        Index("ix_alerts_incident", "incident_id"),
        NEVER_REUSED,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(_run_fk())
    kind: Mapped[str] = mapped_column(String(32))
    tensor_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: tensor_index or -1 (NULLs never collide in a unique index)
    tensor_key: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="open")
    severity: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    count: Mapped[int] = mapped_column(Integer, default=1)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    acknowledged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    acknowledged_by: Mapped[str | None] = mapped_column(String(200), nullable=True)
    #: the incident it belongs to (no foreign key: both rows go with their run; NULL for alerts stored
    #: before incidents existed)
    incident_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: the step its condition began (first_step minus the consecutive steps a rule waited for)
    onset_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Command(Base):
    """A recipe change (or rollback) queued for a run's training job, with its audit trail."""

    __tablename__ = "commands"
    __table_args__ = (Index("ix_commands_run_state", "run_id", "state"), NEVER_REUSED)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(_run_fk())
    kind: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(300))
    changes: Mapped[dict[str, Any]] = mapped_column(JSON)
    previous: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    rollback_of: Mapped[int | None] = mapped_column(Integer, nullable=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    applied_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_by: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    resolved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ReplayRequest(Base):
    """A person's request that an incident's bundle be replayed (the incident page's button), for a replay
    worker (``fp8-monitor replay-worker``) to claim and run (`monitor_server/services/replay_requests.py`).

    ``state``: ``pending`` (waits for a worker), ``running`` (a worker claimed it), ``done`` (the worker's
    replay stored its report on the incident), ``failed`` (``detail`` says why).
    """

    __tablename__ = "replay_requests"
    __table_args__ = (Index("ix_replay_requests_state", "state", "id"), NEVER_REUSED)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(_run_fk())
    incident_id: Mapped[int] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"))
    bundle: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    requested_by: Mapped[str] = mapped_column(String(200))
    claimed_by: Mapped[str | None] = mapped_column(String(200), nullable=True)
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
