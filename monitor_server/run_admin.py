"""Managing runs: tags, the filtered and paged runs list, deleting, closing abandoned runs, retention.

The routes (``api/routes/runs.py``) call these; the periodic maintenance runs them from the service's
background loop (``app.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from monitor_server import retention
from monitor_server.commands import end_commands
from monitor_server.core.db import Database
from monitor_server.models import Alert, Incident, Run, RunTag, as_utc

if TYPE_CHECKING:
    from monitor_server.context import AppContext

log = logging.getLogger("monitor_server.runs")

#: a config filter scans at most this many runs per request (newest first) before it answers with what
#: it found and a cursor to go on from
CONFIG_SCAN_LIMIT = 20_000


def tags_of(session: Session, run_ids: list[int]) -> dict[int, list[str]]:
    """The tags of each run (sorted; runs without tags are absent)."""
    if not run_ids:
        return {}
    out: dict[int, list[str]] = {}
    rows = session.execute(
        select(RunTag.run_id, RunTag.tag).where(RunTag.run_id.in_(run_ids)).order_by(RunTag.tag)
    )
    for run_id, tag in rows:
        out.setdefault(run_id, []).append(tag)
    return out


def set_tags(session: Session, run_id: int, tags: list[str]) -> None:
    """Replace the run's tags."""
    session.execute(delete(RunTag).where(RunTag.run_id == run_id))
    if tags:
        session.add_all(RunTag(run_id=run_id, tag=t) for t in sorted(set(tags)))


@dataclass(frozen=True)
class RunFilter:
    """What the runs list is narrowed to. ``config`` holds ``(key, value)`` pairs: the run's config has
    ``key`` (dots go into nested objects) equal to ``value`` (compared as JSON when it parses as JSON, e.g.
    ``lr=0.001`` or ``recipe=delayed``)."""

    q: str | None = None
    status: str | None = None
    tags: tuple[str, ...] = ()
    config: tuple[tuple[str, str], ...] = ()


def parse_config_filter(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``["lr=0.001", "model.n_layer=4"]`` -> pairs; raises ValueError naming a malformed item."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"config: expected KEY=VALUE, got {item!r}")
        out.append((key, value))
    return tuple(out)


def _config_matches(config: dict[str, Any], pairs: tuple[tuple[str, str], ...]) -> bool:
    for key, want in pairs:
        node: Any = config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        try:
            parsed = json.loads(want)
        except ValueError:
            parsed = want
        if node != parsed and str(node) != want:
            return False
    return True


def list_runs(
    session: Session, flt: RunFilter, limit: int, before: int | None
) -> tuple[list[tuple[Run, int, int]], int | None]:
    """Runs newest first matching `flt`, at most `limit`, with ids below `before`: (rows of (run, open
    alerts, open incidents), the cursor of the next page or None)."""
    open_alerts = (
        select(func.count())
        .where(Alert.run_id == Run.id, Alert.state == "open")
        .correlate(Run)
        .scalar_subquery()
    )
    open_incidents = (
        select(func.count())
        .where(Incident.run_id == Run.id, Incident.state == "open")
        .correlate(Run)
        .scalar_subquery()
    )
    query = select(Run, open_alerts, open_incidents).order_by(Run.id.desc())
    if flt.status is not None:
        query = query.where(Run.status == flt.status)
    if flt.q:
        pattern = "%" + flt.q.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        query = query.where(func.lower(Run.name).like(pattern, escape="\\"))
    for tag in flt.tags:
        query = query.where(Run.id.in_(select(RunTag.run_id).where(RunTag.tag == tag)))
    if not flt.config:
        page = query.limit(limit + 1)
        if before is not None:
            page = page.where(Run.id < before)
        rows = [tuple(r) for r in session.execute(page).all()]
        more = len(rows) > limit
        rows = rows[:limit]
        return rows, (rows[-1][0].id if more and rows else None)
    # config values live in a JSON column: filtered here, scanning newest first in chunks
    found: list[tuple[Run, int, int]] = []
    cursor, scanned = before, 0
    chunk = max(4 * limit, 200)
    while scanned < CONFIG_SCAN_LIMIT:
        page = query.limit(chunk)
        if cursor is not None:
            page = page.where(Run.id < cursor)
        rows = session.execute(page).all()
        if not rows:
            return found, None
        for row in rows:
            scanned += 1
            cursor = row[0].id
            if _config_matches(row[0].config or {}, flt.config):
                found.append(tuple(row))
                if len(found) == limit + 1:
                    return found[:limit], found[limit - 1][0].id
        if len(rows) < chunk:
            return found, None
    return found, cursor  # scan budget spent: the client continues from here


def delete_run(session: Session, run_id: int) -> bool:
    """Delete a run with everything stored for it (its rows go with it: foreign keys cascade)."""
    run = session.get(Run, run_id)
    if run is None:
        return False
    session.delete(run)
    return True


def close_abandoned(db: Database, now: datetime, after_seconds: float) -> list[int]:
    """Runs still "running" with no telemetry (nor registration) for `after_seconds`: their client is gone
    (killed without closing its Monitor). They are marked "crashed"; telemetry arriving later reopens them.
    Returns their ids."""
    if after_seconds <= 0:
        return []
    limit = now - timedelta(seconds=after_seconds)
    closed = []
    with db.write() as session:
        runs = session.scalars(select(Run).where(Run.status == "running")).all()
        for run in runs:
            seen = as_utc(run.last_telemetry_at or run.created_at)
            if seen is not None and seen < limit:
                run.status = "crashed"
                run.updated_at = now
                end_commands(session, run)
                closed.append(run.id)
    for run_id in closed:
        log.info("run %d: no telemetry for %.0f s; closed as crashed", run_id, after_seconds)
    return closed


def apply_retention(db: Database, now: datetime, days: float) -> list[int]:
    """Delete runs that ended (any status but "running") and were last updated more than `days` ago."""
    if days <= 0:
        return []
    limit = now - timedelta(days=days)
    with db.write() as session:
        ids = list(session.scalars(select(Run.id).where(Run.status != "running", Run.updated_at < limit)))
        for run_id in ids:
            delete_run(session, run_id)
    for run_id in ids:
        log.info("run %d: older than the retention period (%g days); deleted", run_id, days)
    return ids


def maintain(ctx: AppContext, now: datetime) -> None:
    """The periodic upkeep of runs: close abandoned ones, delete those past the retention period (the
    dashboards hear of both), compact old per-step statistics into the rollups."""
    after = ctx.settings.close_after_seconds
    for run_id in close_abandoned(ctx.db, now, ctx.settings.stall_seconds if after is None else after):
        ctx.detection.retire(run_id)
        ctx.broker.publish(run_id, "run", {"id": run_id, "status": "crashed"})
    for run_id in apply_retention(ctx.db, now, ctx.settings.retention_days):
        ctx.forget_run(run_id)
        ctx.broker.publish(run_id, "run", {"id": run_id, "deleted": True})
    retention.compact(ctx.db, ctx.settings.raw_steps_kept)
