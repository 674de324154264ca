"""The tables of an export beside the statistics: scalars, events, alerts and replays (their columns
are listed in `export.py`'s docstring), each read in chunks of at most `CHUNK_ROWS` rows, JSON columns (event
details, alert evidence, replay reports) as stored and in chunks of about `CHUNK_BYTES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from sqlalchemy import ColumnElement, Row, Text, and_, cast, func, or_, select
from sqlalchemy.orm import Session

from monitor_server.services.alert_records import alert_public
from monitor_server.storage.models import Alert, EventRow, Incident, IncidentReplay, StepRow, as_utc
from monitor_server.storage.run_meta import RunMeta
from monitor_server.storage.series import scalar_value

#: rows per chunk of the tables without tensors (scalars, events, alerts)
CHUNK_ROWS = 4096
#: the most JSON bytes (event details, alert evidence) one chunk of events or alerts holds: a chunk of
#: 4,096 events of 8 MiB details each would otherwise be 32 GB
CHUNK_BYTES = 4 * 1024 * 1024
#: (step, name) cells per chunk of the scalars table: its width is its number of names, and a chunk
#: costs per column as much as per cell, so chunks are larger than the statistics' (8 MB of values)
SCALAR_CHUNK_CELLS = 1 << 20

SessionFactory = Callable[[], Session]
_TS = pa.timestamp("us", tz="UTC")


def _step_rows(
    sessions: SessionFactory, run_id: int, lo: int, hi: int, per_chunk: int | None = None
) -> Iterator[Sequence[Row[int, dict[str, Any]]]]:
    """Stored `(step, scalars)` rows in [lo, hi], `per_chunk` (default CHUNK_ROWS) at a time."""
    cursor = lo
    while cursor <= hi:
        with sessions() as session:
            rows = session.execute(
                select(StepRow.step, StepRow.scalars)
                .where(StepRow.run_id == run_id, StepRow.step.between(cursor, hi))
                .order_by(StepRow.step)
                .limit(per_chunk or CHUNK_ROWS)
            ).all()
        if not rows:
            return
        yield rows
        cursor = rows[-1].step + 1


def scalar_names(sessions: SessionFactory, run_id: int, lo: int, hi: int) -> list[str]:
    """Every scalar name carried by a stored step in [lo, hi], sorted (a first pass: the columns of a CSV
    header or a Parquet schema must be known before the first row)."""
    names: set[str] = set()
    for rows in _step_rows(sessions, run_id, lo, hi):
        for row in rows:
            names.update(row.scalars or {})
    return sorted(names)


def scalars_schema(names: list[str]) -> pa.Schema:
    """step, then one float64 column per scalar (a scalar called "step" becomes ``scalars.step``)."""
    return pa.schema([("step", pa.int64())] + [(_scalar_column(n), pa.float64()) for n in names])


def _scalar_column(name: str) -> str:
    return "scalars.step" if name == "step" else name


def scalars_table(
    sessions: SessionFactory, run_id: int, names: list[str], lo: int, hi: int
) -> Iterator[pa.Table]:
    """The scalars table in chunks of about SCALAR_CHUNK_CELLS (step, name) cells; null where a step did
    not carry a scalar. Built column-wise in one pass over the values the steps carry (not once per name
    per step, which is quadratic in the names)."""
    schema = scalars_schema(names)
    position = {name: j for j, name in enumerate(names)}
    per_chunk = max(1, SCALAR_CHUNK_CELLS // max(1, len(names)))
    for rows in _step_rows(sessions, run_id, lo, hi, per_chunk):
        values = np.full((len(names), len(rows)), np.nan)
        carried = np.zeros((len(names), len(rows)), dtype=bool)
        for i, row in enumerate(rows):
            scalars = row.scalars
            if not scalars:
                continue
            # numbers and the wire's "NaN" / "Infinity" (what ingest stores: `fp8_protocol.codec.decode_float`
            # refuses booleans) of known names: two C loops
            try:
                js = np.fromiter(map(position.__getitem__, scalars), np.intp, len(scalars))
                vs = np.fromiter(scalars.values(), np.float64, len(scalars))
            except (KeyError, TypeError, ValueError):  # anything else, one value at a time
                pairs = [(position.get(k), scalar_value(v)) for k, v in scalars.items()]
                kept = [(j, v) for j, v in pairs if j is not None and v is not None]
                js = np.array([j for j, _ in kept], np.intp)
                vs = np.array([v for _, v in kept], np.float64)
            values[js, i] = vs
            carried[js, i] = True
        columns = [pa.array([r.step for r in rows], pa.int64())]
        columns += [pa.array(values[j], mask=~carried[j]) for j in range(len(names))]
        yield pa.Table.from_arrays(columns, schema=schema)


EVENTS_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("step", pa.int64()),
        ("kind", pa.string()),
        ("created_at", _TS),
        ("details", pa.string()),
    ]
)


def _byte_chunks(sizes: list[tuple[int, int]]) -> Iterator[list[int]]:
    """Ids (in the given order) grouped so that each group's sizes sum to at most CHUNK_BYTES (a single
    larger one alone)."""
    group: list[int] = []
    total = 0
    for row_id, size in sizes:
        if group and total + size > CHUNK_BYTES:
            yield group
            group, total = [], 0
        group.append(row_id)
        total += size
    if group:
        yield group


def events_table(sessions: SessionFactory, run_id: int, lo: int, hi: int) -> Iterator[pa.Table]:
    """The run's client events in [lo, hi] in step order (then arrival order), in chunks of at most
    CHUNK_ROWS events and about CHUNK_BYTES of details. The details are written as stored (JSON text, as
    the database holds it), never parsed and encoded again."""
    after: tuple[int, int] | None = None
    details_text = cast(EventRow.details, Text)
    size = func.coalesce(EventRow.details_bytes, func.length(details_text))
    while True:
        query = select(EventRow.id, EventRow.step, size).where(
            EventRow.run_id == run_id, EventRow.step.between(lo, hi)
        )
        if after is not None:
            step, eid = after
            query = query.where(or_(EventRow.step > step, and_(EventRow.step == step, EventRow.id > eid)))
        with sessions() as session:
            heads = session.execute(query.order_by(EventRow.step, EventRow.id).limit(CHUNK_ROWS)).all()
        if not heads:
            return
        for ids in _byte_chunks([(h[0], h[2] or 0) for h in heads]):
            with sessions() as session:
                rows = session.execute(
                    select(EventRow.id, EventRow.step, EventRow.kind, EventRow.created_at, details_text)
                    .where(EventRow.id.in_(ids))
                    .order_by(EventRow.step, EventRow.id)
                ).all()
            yield pa.table(
                [
                    pa.array([r[0] for r in rows], pa.int64()),
                    pa.array([r[1] for r in rows], pa.int64()),
                    pa.array([r[2] for r in rows], pa.string()),
                    pa.array([as_utc(r[3]) for r in rows], _TS),
                    pa.array([r[4] for r in rows], pa.string()),
                ],
                schema=EVENTS_SCHEMA,
            )
            del rows
        after = (heads[-1][1], heads[-1][0])


_I64, _STR = pa.int64(), pa.string()


ALERTS_SCHEMA = pa.schema(
    [
        ("id", _I64),
        ("kind", _STR),
        ("tensor_index", _I64),
        ("tensor_name", _STR),
        ("layer", _STR),
        ("state", _STR),
        ("severity", _STR),
        ("message", _STR),
        ("onset_step", _I64),
        ("first_step", _I64),
        ("last_step", _I64),
        ("count", _I64),
        ("incident_id", _I64),
        ("created_at", _TS),
        ("updated_at", _TS),
        ("acknowledged_at", _TS),
        ("acknowledged_by", _STR),
        ("evidence", _STR),
    ]
)


def alerts_table(sessions: SessionFactory, meta: RunMeta, lo: int, hi: int) -> Iterator[pa.Table]:
    """The run's alerts whose steps overlap [lo, hi], by id, in chunks of at most CHUNK_ROWS alerts and about
    CHUNK_BYTES of evidence, the evidence written as stored."""
    after = 0
    evidence_text = cast(Alert.evidence, Text).label("evidence_json")
    in_range = (Alert.run_id == meta.run_id, Alert.last_step >= lo, Alert.first_step <= hi)
    while True:
        with sessions() as session:
            heads = session.execute(
                select(Alert.id, func.length(evidence_text))
                .where(*in_range, Alert.id > after)
                .order_by(Alert.id)
                .limit(CHUNK_ROWS)
            ).all()
        if not heads:
            return
        for ids in _byte_chunks([(h[0], h[1] or 0) for h in heads]):
            with sessions() as session:
                rows = session.execute(
                    select(Alert, evidence_text).where(Alert.id.in_(ids)).order_by(Alert.id)
                ).all()
                records = []
                for alert, evidence in rows:
                    session.expunge(alert)
                    record = alert_public(alert, meta)
                    record["evidence"] = evidence
                    records.append({name: record[name] for name in ALERTS_SCHEMA.names})
            yield pa.Table.from_pylist(records, schema=ALERTS_SCHEMA)
            del records, rows
        after = heads[-1][0]


REPLAYS_SCHEMA = pa.schema(
    [
        ("incident_id", _I64),
        ("verdict", _STR),
        ("culprits", _STR),
        ("updated_at", _TS),
        ("updated_by", _STR),
        ("report", _STR),
    ]
)


def replays_in_range(run_id: int, lo: int, hi: int) -> tuple[ColumnElement[bool], ...]:
    """The conditions of a run's replays whose incident's steps overlap [lo, hi] (joined to incidents)."""
    return (
        IncidentReplay.run_id == run_id,
        Incident.id == IncidentReplay.incident_id,
        Incident.last_step >= lo,
        Incident.first_step <= hi,
    )


def replays_table(sessions: SessionFactory, run_id: int, lo: int, hi: int) -> Iterator[pa.Table]:
    """The run's incident replays (see `REPLAYS_SCHEMA`) by incident id, in chunks of about CHUNK_BYTES
    of reports (a report is at most `max_replay_bytes`)."""
    report_text = cast(IncidentReplay.report, Text).label("report_json")
    with sessions() as session:
        heads = session.execute(
            select(IncidentReplay.incident_id, func.length(report_text))
            .where(*replays_in_range(run_id, lo, hi))
            .order_by(IncidentReplay.incident_id)
        ).all()
    for ids in _byte_chunks([(h[0], h[1] or 0) for h in heads]):
        with sessions() as session:
            rows = session.execute(
                select(IncidentReplay, report_text)
                .where(IncidentReplay.incident_id.in_(ids))
                .order_by(IncidentReplay.incident_id)
            ).all()
            records = [
                {
                    "incident_id": row.incident_id,
                    "verdict": row.verdict,
                    "culprits": ",".join(row.report.get("culprits", [])),
                    "updated_at": as_utc(row.updated_at),
                    "updated_by": row.updated_by,
                    "report": report,
                }
                for row, report in rows
            ]
        yield pa.Table.from_pylist(records, schema=REPLAYS_SCHEMA)
        del records, rows
