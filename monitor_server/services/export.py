"""A run's tables as CSV or Parquet, streamed in chunks of steps (`GET /runs/{id}/export`).

A run can hold 512 tensors x 100,000 steps (3 * 10^8 statistic values): no table is ever built whole. Each
table is read through a keyset cursor, about `CHUNK_CELLS` (step, tensor) pairs at a time, in a fresh read
session per chunk (so a slow download holds no snapshot for minutes), turned into an Arrow table and
handed to a pyarrow writer whose output is drained after every chunk. Parquet gets one row group per chunk.

Tables and their columns:

- ``stats``, ``layout=long``: one row per (step, tensor): ``step, tensor, layer, role, amax, scale,
  overflow, underflow, nonfinite, numel`` (tensors in index order within a step), then the quality columns
  (``sum_sq, err_sq, subnormal, min_abs``) where some step of the range stored them, then the block columns
  (``blocks, blocks_at_limit, blocks_overflow, blocks_underflow, block_range``) likewise
  (`exported_columns`); a step that did not carry a group has NaN in its columns (null in Parquet's
  integer counts).
- ``stats``, ``layout=wide``: one row per step: ``step``, then per tensor (index order) per statistic (the
  same ones, in the same order) a column ``<tensor name>.<statistic>``, e.g. ``blocks.0.attn.qkv.input.amax``.
- ``scalars``: one row per stored step: ``step``, then one column per scalar name (sorted); empty / null
  where the step did not carry that scalar (a NaN it carried stays NaN).
- ``events``: ``id, step, kind, created_at, details`` (details as JSON text, non-finite floats spelled as
  on the wire).
- ``alerts``: the fields of ``GET /runs/{id}/alerts`` (evidence as JSON text), by id.
- ``replays``: one row per replayed incident whose steps overlap the range, by incident id: ``incident_id,
  verdict, culprits`` (comma-separated, the most likely first) ``, updated_at, updated_by, report`` (the
  report as JSON text, as stored; ``monitor_server/services/replays.py``).

A download is whole or visibly cut off: the rows each table holds in the range are counted when the export
starts, and an export that ends with fewer (the run deleted, or its statistics compacted, while it was
read) raises `ExportIncomplete` before the file's last bytes, so the server drops the connection without
ending the chunked response and the client sees an incomplete transfer instead of a well-formed, shorter
file. Rows stored while it runs may make it longer, never shorter.

Statistics and scalars are float64 as stored, except the counts in Parquet (`COUNT_COLUMNS`: overflow,
underflow, nonfinite, numel, subnormal and the block counts), which are int64 there, null where a step did
not carry them (or a sender stored something that is not a whole number there); CSV writes a whole number
the same either way. The amax of a tensor whose elements were all NaN is NaN (`stored_amax`; a run stored
before the service stored it so has 0 there, and is exported with NaN too). Non-finite values are carried
natively: CSV writes ``nan``, ``inf`` and ``-inf``; Parquet stores the IEEE values. CSV floats use the
shortest text that reads back to the same float64, so a CSV round trip is exact too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
from sqlalchemy import func, select

from fp8_protocol.stats import BASE_COLUMNS, BLOCK_COLUMNS, COUNT_COLUMNS, QUALITY_COLUMNS, stored_amax
from monitor_server.services.export_tables import (
    ALERTS_SCHEMA,
    EVENTS_SCHEMA,
    REPLAYS_SCHEMA,
    SessionFactory,
    alerts_table,
    events_table,
    replays_in_range,
    replays_table,
    scalar_names,
    scalars_schema,
    scalars_table,
)
from monitor_server.storage.models import Alert, EventRow, Incident, IncidentReplay, StepRow, StepStat
from monitor_server.storage.run_meta import RunMeta
from monitor_server.storage.stat_rows import STAT_IDS, unpack_rows

FORMATS = ("csv", "parquet")
TABLES = ("stats", "scalars", "events", "alerts", "replays")
LAYOUTS = ("long", "wide")
MEDIA_TYPES = {"csv": "text/csv; charset=utf-8", "parquet": "application/vnd.apache.parquet"}

#: (step, tensor) pairs per chunk: 65,536 rows of the long layout, 3 MB of statistics
CHUNK_CELLS = 65_536
#: the most row groups of a wide Parquet file (see `stats_wide`): about the least memory at 512 tensors x
#: 100,000 steps, where metadata and one row group then weigh about the same
WIDE_PARQUET_ROW_GROUPS = 48
#: the most columns (tensors x statistics) of a wide Parquet file: its writer keeps ~0.9 kB of metadata per
#: column per row group until the file is closed, and a row group is held whole (512 tensors x 6 base
#: statistics; a wider run exports in the long layout, or as CSV)
WIDE_PARQUET_MAX_COLUMNS = 3072

log = logging.getLogger("fp8scope.monitor")


def filename(run_id: int, table: str, fmt: str) -> str:
    """The download's file name: ``run-<id>-<table>.<csv|parquet>``."""
    return f"run-{run_id}-{table}.{fmt}"


class _Sink:
    """A write-only file for the pyarrow writers whose bytes are taken out after each chunk."""

    closed = False

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._pos = 0

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._parts.append(chunk)
        self._pos += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def encode(fmt: str, schema: pa.Schema, tables: Iterator[pa.Table]) -> Iterator[bytes]:
    """The bytes of a CSV or Parquet file holding `tables` (all of `schema`), yielded chunk by chunk."""
    sink = _Sink()
    if fmt == "csv":
        writer: Any = pa_csv.CSVWriter(
            sink, schema, write_options=pa_csv.WriteOptions(quoting_style="needed")
        )
    else:
        writer = pq.ParquetWriter(sink, schema, compression="zstd")
    try:
        for table in tables:
            writer.write_table(table)
            del table  # the next chunk is read while this loop holds nothing of the last one
            data = sink.take()
            if data:
                yield data
    finally:
        writer.close()
    yield sink.take()


# --- statistics -------------------------------------------------------------------------------------


def _chunk_steps(num_tensors: int) -> int:
    return max(1, CHUNK_CELLS // max(1, num_tensors))


def _count_stat_steps(sessions: SessionFactory, run_id: int, lo: int, hi: int) -> int:
    with sessions() as session:
        query = select(func.count()).where(
            StepStat.run_id == run_id, StepStat.metric == STAT_IDS["amax"], StepStat.step.between(lo, hi)
        )
        return session.scalar(query) or 0


def exported_columns(sessions: SessionFactory, run_id: int, lo: int, hi: int) -> tuple[str, ...]:
    """The statistics exported for steps [lo, hi]: the base columns, and the quality and the block columns
    each where some step of the range stored them (a step carries a group all or not at all), in
    `STAT_IDS` order (ascending ids)."""
    columns = BASE_COLUMNS
    with sessions() as session:
        for group in (QUALITY_COLUMNS, BLOCK_COLUMNS):
            stored = session.scalar(
                select(StepStat.step)
                .where(
                    StepStat.run_id == run_id,
                    StepStat.metric == STAT_IDS[group[0]],
                    StepStat.step.between(lo, hi),
                )
                .limit(1)
            )
            if stored is not None:
                columns += group
    return columns


@dataclass(frozen=True)
class StatsRange:
    """What a statistics export reads: the statistics `columns` of the run `meta`'s steps [lo, hi]."""

    sessions: SessionFactory
    meta: RunMeta
    columns: tuple[str, ...]
    lo: int
    hi: int


def _stat_chunks(read: StatsRange, per_chunk: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(steps (S,), statistics (S, len(columns), T) in `columns` order) for the steps of `read` that
    hold statistics, about `per_chunk` steps (default: about CHUNK_CELLS (step, tensor) pairs) at a time;
    NaN for a column that a step did not store (a group it did not carry).

    Steps with scalars only (no FP8 layer ran) have no `StepStat` rows and so are not in any chunk. The
    values of a chunk come from one SELECT, so a batch stored meanwhile is in it whole or not at all.
    """
    sessions, meta, columns, lo, hi = read.sessions, read.meta, read.columns, read.lo, read.hi
    T, n_stats = meta.num_tensors, len(columns)
    per_chunk = per_chunk or _chunk_steps(T)
    ids = [STAT_IDS[name] for name in columns]
    column_of = np.full(max(STAT_IDS.values()) + 1, -1, dtype=np.int64)
    column_of[ids] = np.arange(n_stats)
    cursor = lo
    while cursor <= hi:
        with sessions() as session:
            # where the chunk ends: the per_chunk-th step holding statistics (every one has an amax row)
            last = session.scalar(
                select(StepStat.step)
                .where(
                    StepStat.run_id == meta.run_id,
                    StepStat.metric == STAT_IDS["amax"],
                    StepStat.step.between(cursor, hi),
                )
                .order_by(StepStat.step)
                .offset(per_chunk - 1)
                .limit(1)
            )
            end = hi if last is None else last
            rows = session.execute(
                select(StepStat.step, StepStat.metric, StepStat.values)
                .where(
                    StepStat.run_id == meta.run_id,
                    StepStat.metric.in_(ids),
                    StepStat.step.between(cursor, end),
                )
                .order_by(StepStat.step, StepStat.metric)
            ).all()
        if not rows:
            return
        row_steps = np.fromiter((r.step for r in rows), np.int64, len(rows))
        steps, step_pos = np.unique(row_steps, return_inverse=True)
        col_pos = column_of[np.fromiter((r.metric for r in rows), np.int64, len(rows))]
        values = unpack_rows([r.values for r in rows], T)
        if len(rows) == len(steps) * n_stats:  # every step stored every column: rows are the cube in order
            cube = values.reshape(len(steps), n_stats, T)
        else:
            cube = np.full((len(steps), n_stats, T), np.nan)
            cube[step_pos, col_pos] = values
        # an all-NaN tensor's amax as stored since the service stores it as NaN (0 in runs stored before)
        amax = columns.index("amax")
        cube[:, amax] = stored_amax(
            cube[:, amax], cube[:, columns.index("numel")], cube[:, columns.index("nonfinite")]
        )
        yield steps, cube
        if last is None:
            return
        cursor = end + 1


def _stat_type(name: str, integer_counts: bool) -> pa.DataType:
    """A statistic's column type: int64 for a count with `integer_counts` (Parquet), float64 otherwise (CSV,
    whose text is the same for a whole number, writes ``nan`` where a step did not carry the column)."""
    return pa.int64() if integer_counts and name in COUNT_COLUMNS else pa.float64()


def _stat_array(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    """One exported column of statistics (float64 values as stored) of type `type_`: floats as they are (no
    copy); counts as int64, null where there is no whole number (NaN: a step that did not carry the
    column)."""
    if type_ != pa.int64():
        return pa.array(values)
    whole = np.isfinite(values) & (np.abs(values) < 2.0**63)
    whole &= np.floor(values, where=whole, out=np.zeros_like(values)) == values
    return pa.array(np.where(whole, values, 0).astype(np.int64), mask=None if whole.all() else ~whole)


def stats_long_schema(columns: tuple[str, ...], integer_counts: bool = False) -> pa.Schema:
    """Columns of the long statistics table, with the statistics `columns` (the counts int64 with
    `integer_counts`)."""
    names = pa.dictionary(pa.int32(), pa.string())
    fields = [("step", pa.int64()), ("tensor", names), ("layer", names), ("role", names)]
    return pa.schema(fields + [(name, _stat_type(name, integer_counts)) for name in columns])


def stats_wide_schema(meta: RunMeta, columns: tuple[str, ...], integer_counts: bool = False) -> pa.Schema:
    """Columns of the wide statistics table: step, then ``<tensor>.<statistic>`` in tensor order (the counts
    int64 with `integer_counts`)."""
    cols = [(f"{t.name}.{name}", _stat_type(name, integer_counts)) for t in meta.tensors for name in columns]
    return pa.schema([("step", pa.int64()), *cols])


def stats_long(read: StatsRange, integer_counts: bool = False) -> Iterator[pa.Table]:
    """The long statistics table in chunks: rows step-major, tensors in index order within a step."""
    meta, columns = read.meta, read.columns
    schema = stats_long_schema(columns, integer_counts)
    T = meta.num_tensors
    layers = list(meta.layers)
    roles = sorted({t.role for t in meta.tensors})
    tensor_dict = pa.array([t.name for t in meta.tensors], pa.string())
    layer_idx = np.array([layers.index(t.layer) for t in meta.tensors], dtype=np.int32)
    role_idx = np.array([roles.index(t.role) for t in meta.tensors], dtype=np.int32)
    for steps, cube in _stat_chunks(read):
        S = len(steps)
        tensor_of_row = np.tile(np.arange(T, dtype=np.int32), S)  # (S*T,) row = step-major
        arrays = [
            pa.array(np.repeat(steps, T)),
            pa.DictionaryArray.from_arrays(tensor_of_row, tensor_dict),
            pa.DictionaryArray.from_arrays(layer_idx[tensor_of_row], pa.array(layers, pa.string())),
            pa.DictionaryArray.from_arrays(role_idx[tensor_of_row], pa.array(roles, pa.string())),
        ]
        for j, name in enumerate(columns):
            arrays.append(_stat_array(cube[:, j, :].reshape(-1), schema.field(name).type))
        yield pa.Table.from_arrays(arrays, schema=schema)


def stats_wide(
    read: StatsRange, row_groups: int | None = None, integer_counts: bool = False
) -> Iterator[pa.Table]:
    """The wide statistics table in chunks: one row per step (the counts int64 with `integer_counts`).

    `row_groups`: for Parquet, at most about this many chunks. A Parquet writer keeps about 0.9 kB of
    metadata per column per row group until the file is closed: with 3,072 columns, 128-step row groups
    of a 100,000-step run would hold 2 GB of it. Fewer, larger chunks trade that for a larger chunk, which
    is filled from reads of the usual size so that it is held once.
    """
    meta = read.meta
    schema = stats_wide_schema(meta, read.columns, integer_counts)
    n_cols = meta.num_tensors * len(read.columns)
    per_read = _chunk_steps(meta.num_tensors)
    per_table = per_read
    if row_groups:
        want = -(-_count_stat_steps(read.sessions, meta.run_id, read.lo, read.hi) // row_groups)
        per_table = max(1, -(-want // per_read)) * per_read  # whole reads per table
    # (T * statistics, steps): each output column is one contiguous row, so Arrow takes it without a copy;
    # rows are tensor-major, statistic-minor like the schema
    steps_parts: list[np.ndarray] = []
    block, filled = np.empty((n_cols, per_table)), 0
    for steps, cube in _stat_chunks(read, per_read):
        n = len(steps)
        if filled + n > block.shape[1] and filled:  # a read that does not fit (a batch landed meanwhile)
            yield _wide_table(schema, steps_parts, block[:, :filled])
            block, steps_parts, filled = np.empty((n_cols, max(per_table, n))), [], 0
        block[:, filled : filled + n] = cube.transpose(2, 1, 0).reshape(n_cols, n)
        steps_parts.append(steps)
        filled += n
        if filled == block.shape[1]:
            yield _wide_table(schema, steps_parts, block)
            block, steps_parts, filled = np.empty((n_cols, per_table)), [], 0
    if filled:
        yield _wide_table(schema, steps_parts, block[:, :filled])


def _wide_table(schema: pa.Schema, steps_parts: list[np.ndarray], block: np.ndarray) -> pa.Table:
    # each row of the block, cut short or not, is contiguous: Arrow wraps a float one without a copy
    columns = [pa.array(np.concatenate(steps_parts))] + [
        _stat_array(row, field.type) for row, field in zip(block, list(schema)[1:], strict=True)
    ]
    return pa.Table.from_arrays(columns, schema=schema)


class ExportTooWide(ValueError):
    """A wide Parquet export over `WIDE_PARQUET_MAX_COLUMNS` columns (refused before anything is read)."""


class ExportIncomplete(RuntimeError):
    """An export ended with fewer rows than its range held when it started: the run was deleted, or its
    per-step statistics compacted, while it was read."""


def stored_rows(sessions: SessionFactory, meta: RunMeta, table: str, layout: str, lo: int, hi: int) -> int:
    """The rows `table` of steps [lo, hi] has now (what a whole export of it writes, at least)."""
    run_id = meta.run_id
    if table == "stats":
        steps = _count_stat_steps(sessions, run_id, lo, hi)
        return steps if layout == "wide" else steps * meta.num_tensors
    if table == "scalars":
        query = select(func.count()).where(StepRow.run_id == run_id, StepRow.step.between(lo, hi))
    elif table == "events":
        query = select(func.count()).where(EventRow.run_id == run_id, EventRow.step.between(lo, hi))
    elif table == "replays":
        query = select(func.count()).select_from(IncidentReplay, Incident)
        query = query.where(*replays_in_range(run_id, lo, hi))
    else:
        query = select(func.count()).where(
            Alert.run_id == run_id, Alert.last_step >= lo, Alert.first_step <= hi
        )
    with sessions() as session:
        return session.scalar(query) or 0


def _whole(tables: Iterator[pa.Table], expected: int, what: str) -> Iterator[pa.Table]:
    """`tables`, then `ExportIncomplete` when they held fewer than `expected` rows in all."""
    written = 0
    for table in tables:
        written += table.num_rows
        yield table
    if written < expected:
        log.warning(
            "export of %s cut off: %d of %d rows (deleted or compacted meanwhile)", what, written, expected
        )
        raise ExportIncomplete(f"{what}: {written} of {expected} rows; deleted or compacted while exported")


def check_width(meta: RunMeta, columns: tuple[str, ...], fmt: str) -> None:
    """ExportTooWide for a wide file of `columns` that is over its budget (Parquet only)."""
    width = meta.num_tensors * len(columns)
    if fmt == "parquet" and width > WIDE_PARQUET_MAX_COLUMNS:
        raise ExportTooWide(
            f"layout=wide: a Parquet file of {width} columns ({meta.num_tensors} tensors x "
            f"{len(columns)} statistics) is over the {WIDE_PARQUET_MAX_COLUMNS}-column budget of the "
            "wide layout; take layout=long (the same values, one row per step and tensor) or format=csv"
        )


def refusal(
    sessions: SessionFactory, meta: RunMeta, table: str, layout: str, fmt: str, lo: int, hi: int
) -> None:
    """ExportTooWide when `export` would refuse the request (checked before an export slot is taken)."""
    if table == "stats" and layout == "wide":
        check_width(meta, exported_columns(sessions, meta.run_id, lo, hi), fmt)


def export(
    sessions: SessionFactory, meta: RunMeta, table: str, layout: str, fmt: str, lo: int, hi: int
) -> Iterator[bytes]:
    """The bytes of one exported table of steps [lo, hi] (a range with lo > hi exports no rows).

    Raises:
        ExportTooWide: at once, for a wide Parquet file over `WIDE_PARQUET_MAX_COLUMNS` columns.
        ExportIncomplete: while iterating, before the file's last bytes: the range lost rows while it was
            exported (see the module's docstring).
    """
    ints = fmt == "parquet"  # counts as integers where the format has types
    expected = stored_rows(sessions, meta, table, layout, lo, hi)
    if table == "stats":
        read = StatsRange(sessions, meta, exported_columns(sessions, meta.run_id, lo, hi), lo, hi)
    if table == "stats" and layout == "wide":
        groups = WIDE_PARQUET_ROW_GROUPS if fmt == "parquet" else None
        check_width(meta, read.columns, fmt)
        schema = stats_wide_schema(meta, read.columns, ints)
        tables = stats_wide(read, groups, ints)
    elif table == "stats":
        schema = stats_long_schema(read.columns, ints)
        tables = stats_long(read, ints)
    elif table == "scalars":
        names = scalar_names(sessions, meta.run_id, lo, hi)
        schema, tables = scalars_schema(names), scalars_table(sessions, meta.run_id, names, lo, hi)
    elif table == "events":
        schema, tables = EVENTS_SCHEMA, events_table(sessions, meta.run_id, lo, hi)
    elif table == "replays":
        schema, tables = REPLAYS_SCHEMA, replays_table(sessions, meta.run_id, lo, hi)
    else:
        schema, tables = ALERTS_SCHEMA, alerts_table(sessions, meta, lo, hi)
    return encode(fmt, schema, _whole(tables, expected, f"run {meta.run_id} {table}"))
