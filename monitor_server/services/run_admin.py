"""Managing runs: tags, the filtered and paged runs list, deleting, closing abandoned runs, retention.

The routes (``api/routes/runs.py``) call these; the periodic maintenance runs them from the service's
background loop (``app.py``).
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from monitor_server.core.config import Settings
from monitor_server.core.db import Database
from monitor_server.infra.events import EventBroker
from monitor_server.infra.wire import json_too_deep
from monitor_server.services.alerting import AlertService
from monitor_server.services.commands import end_commands
from monitor_server.storage import retention, run_sort
from monitor_server.storage.models import Alert, Command, Incident, Run, RunTag, TensorRow, as_utc
from monitor_server.storage.run_sort import RunSort
from monitor_server.storage.schemas import RunCreate, RunUpdate

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


def set_tags(session: Session, *, run_id: int, tags: list[str]) -> None:
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


#: the deepest JSON value a config filter may compare (a run's config is bounded by max_json_depth, 32)
MAX_FILTER_DEPTH = 32


def _filter_value(want: str) -> Any:
    """A filter's VALUE as JSON when it is JSON, else the text itself; ValueError when it nests deeper than
    `MAX_FILTER_DEPTH` (orjson stops at 1024 levels with an error, where Python's parser would exhaust the
    stack; comparing a deep value would recurse as deep)."""
    try:
        parsed = orjson.loads(want)
    except orjson.JSONDecodeError as exc:
        if "depth limit exceeded" not in str(exc):
            return want
        parsed = None
    if parsed is None or json_too_deep(parsed, MAX_FILTER_DEPTH):
        raise ValueError(f"nests deeper than {MAX_FILTER_DEPTH} levels")
    return parsed


def parse_config_filter(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``["lr=0.001", "model.n_layer=4"]`` -> pairs; raises ValueError naming a malformed item, or a value
    nested deeper than `MAX_FILTER_DEPTH`."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"config: expected KEY=VALUE, got {item[:100]!r}")
        try:
            _filter_value(value)
        except ValueError as exc:
            raise ValueError(f"config: the value of {key[:100]!r} {exc}") from None
        out.append((key, value))
    return tuple(out)


def _config_matches(config: dict[str, Any], pairs: tuple[tuple[str, str], ...]) -> bool:
    for key, want in pairs:
        node = run_sort.config_value(config, key)
        if node is run_sort.MISSING:
            return False
        parsed = _filter_value(want)
        if node != parsed and str(node) != want:
            return False
    return True


def list_runs(
    session: Session, *, flt: RunFilter, limit: int, sort: RunSort | None = None, cursor: str | None = None
) -> tuple[list[tuple[Run, int, int]], str | None]:
    """Runs matching `flt` in `sort`'s order (None: newest first), at most `limit`, after `cursor` (the
    previous page's; for the newest-first order a run id, the list going on below it): (rows of (run, open
    alerts, open incidents), the cursor of the next page or None). ValueError for a cursor of another order,
    or a config-value sort over more than `run_sort.CONFIG_SORT_LIMIT` runs."""
    open_alerts = (
        select(func.count())
        .where(Alert.run_id == Run.id, Alert.state == "open")
        .correlate(Run)
        .scalar_subquery()
    )
    query = select(Run, open_alerts, run_sort.open_incidents_count())
    if flt.status is not None:
        query = query.where(Run.status == flt.status)
    if flt.q:
        pattern = "%" + flt.q.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        query = query.where(func.lower(Run.name).like(pattern, escape="\\"))
    for tag in flt.tags:
        query = query.where(Run.id.in_(select(RunTag.run_id).where(RunTag.tag == tag)))
    if sort is not None and sort.config_key is not None:
        return _by_config_value(session, query, flt, sort, limit, cursor)
    if sort is None:  # newest first: the id is the order and the cursor
        if cursor is not None and not (cursor.isdigit() and 1 <= int(cursor) <= 2**31 - 1):
            raise ValueError("cursor: not a cursor of the runs list newest first (a run id)")
        query = query.add_columns(Run.id).order_by(Run.id.desc())
        start: tuple[Any, int] | None = None if cursor is None else (int(cursor), int(cursor))
        after, make_cursor = _below, _id_cursor
    else:
        expr = run_sort.sort_expression(sort, session.get_bind().dialect.name)
        query = query.add_columns(expr).order_by(*run_sort.order_by(sort, expr))
        start = None if cursor is None else run_sort.decode_cursor(sort, cursor)
        after = functools.partial(run_sort.after, sort, expr)
        make_cursor = functools.partial(run_sort.encode_cursor, sort)
    # config values live in a JSON column: filtered here, scanning in chunks in the list's order
    chunk = max(4 * limit, 200) if flt.config else limit + 1
    found: list[tuple[Run, int, int]] = []
    last: tuple[Any, int] | None = None  # the sort value and id of the last run found
    scanned = 0
    while scanned < CONFIG_SCAN_LIMIT:
        page = query.limit(chunk) if start is None else query.where(after(*start)).limit(chunk)
        rows: Sequence[Any] = session.execute(page).all()  # (run, alerts, incidents, sort value)
        for run, n_alerts, n_incidents, value in rows:
            scanned += 1
            start = (value, run.id)
            if flt.config and not _config_matches(run.config or {}, flt.config):
                continue
            if last is not None and len(found) == limit:  # one more than a page: there is a next one
                return found, make_cursor(*last)
            found.append((run, n_alerts, n_incidents))
            last = (value, run.id)
        if len(rows) < chunk:
            return found, None
    # scan budget spent: the client continues from the last run scanned
    return found, None if start is None else make_cursor(*start)


def _below(value: Any, run_id: int) -> Any:
    return Run.id < run_id


def _id_cursor(value: Any, run_id: int) -> str:
    return str(run_id)


def _by_config_value(
    session: Session, query: Any, flt: RunFilter, sort: RunSort, limit: int, cursor: str | None
) -> tuple[list[tuple[Run, int, int]], str | None]:
    """A page of the runs sorted by a config value: every matching run's config read, sorted here."""
    ids = query.with_only_columns(Run.id, Run.config).limit(run_sort.CONFIG_SORT_LIMIT + 1)
    rows: Sequence[Any] = session.execute(ids).all()  # (id, config)
    if len(rows) > run_sort.CONFIG_SORT_LIMIT:
        raise ValueError(
            f"sort: a config value sorts at most {run_sort.CONFIG_SORT_LIMIT} runs; "
            "narrow the list with a filter (status, tag, name)"
        )
    key = sort.config_key or ""
    ranked = sorted(
        (run_sort.config_order_key(sort, rank, run_id), rank, run_id)
        for run_id, config in rows
        if not flt.config or _config_matches(config or {}, flt.config)
        for rank in [run_sort.config_rank(run_sort.config_value(config, key))]
    )
    begin = 0
    if cursor is not None:
        rank, run_id = run_sort.decode_cursor(sort, cursor)
        begin = bisect.bisect_right([r[0] for r in ranked], run_sort.config_order_key(sort, rank, run_id))
    page = ranked[begin : begin + limit]
    picked: Sequence[Any] = session.execute(query.where(Run.id.in_([r[2] for r in page]))).all()
    loaded: dict[int, tuple[Run, int, int]] = {run.id: (run, alerts, n) for run, alerts, n in picked}
    found = [loaded[run_id] for _, _, run_id in page if run_id in loaded]
    more = begin + limit < len(ranked)
    return found, run_sort.encode_cursor(sort, page[-1][1], page[-1][2]) if more and page else None


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


def maintain(
    *,
    db: Database,
    settings: Settings,
    detection: AlertService,
    broker: EventBroker,
    forget_run: Callable[[int], None],
    now: datetime,
) -> None:
    """The periodic upkeep of runs: close abandoned ones, delete those past the retention period (the
    dashboards hear of both, and `forget_run` drops a deleted run's caches), compact old per-step
    statistics into the rollups."""
    after = settings.close_after_seconds
    for run_id in close_abandoned(db, now, settings.stall_seconds if after is None else after):
        detection.retire(run_id)
        broker.publish(run_id, "run", {"id": run_id, "status": "crashed"})
    for run_id in apply_retention(db, now, settings.retention_days):
        forget_run(run_id)
        broker.publish(run_id, "run", {"id": run_id, "deleted": True})
    retention.compact(db, settings.raw_steps_kept)


def count_open_alerts(session: Session, run_id: int) -> int:
    """Open alerts of one run."""
    return session.scalar(select(func.count()).where(Alert.run_id == run_id, Alert.state == "open")) or 0


def count_open_incidents(session: Session, run_id: int) -> int:
    """Open incidents of one run."""
    query = select(func.count()).where(Incident.run_id == run_id, Incident.state == "open")
    return session.scalar(query) or 0


def run_by_client_key(session: Session, client_key: str) -> Run | None:
    """The run registered with `client_key`, if any."""
    return session.scalar(select(Run).where(Run.client_key == client_key))


def insert_run(session: Session, *, body: RunCreate, owner: str | None, now: datetime) -> Run:
    """Register a run: its row, its tensors (in index order) and its tags; flushed, so it has its id."""
    run = Run(
        name=body.name,
        config=body.config,
        recipe=body.recipe,
        recipe_overrides={"model": {}, "layers": {}},
        world_size=body.world_size,
        host=body.host,
        status="running",
        num_tensors=len(body.tensors),
        created_at=now,
        updated_at=now,
        steps_stored=0,
        client_key=body.client_key,
        owner=owner,
    )
    session.add(run)
    session.flush()
    if body.tensors:  # a run without FP8 (a bf16 / fp32 baseline) registers none
        tensors = sorted(body.tensors, key=lambda t: t.index)
        session.execute(insert(TensorRow), [{"run_id": run.id, **t.model_dump()} for t in tensors])
    set_tags(session, run_id=run.id, tags=body.tags)
    return run


def update_run(session: Session, run: Run, *, body: RunUpdate, now: datetime) -> list[Command]:
    """Change what `body` sets of the run (status, name, tags, notes; each replaced whole); returns the
    commands a run that ended rejected (those not yet applied)."""
    ended: list[Command] = []
    if body.status is not None:
        run.status = body.status
        if body.status != "running":
            ended = end_commands(session, run)
    if body.name is not None:
        run.name = body.name
    if body.tags is not None:
        set_tags(session, run_id=run.id, tags=body.tags)
    if body.notes is not None:
        run.notes = body.notes
    run.updated_at = now
    session.flush()
    return ended
