"""The telemetry hot path: decode a batch (orjson + numpy, no per-value Python work for packed columns)
and store it in one transaction (steps, per-statistic blobs, rollups, acks, idempotency key).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

import numpy as np
import orjson
from sqlalchemy import Table, insert, select
from sqlalchemy.orm import Session

from fp8_protocol.client_events import EVENT_FIELDS, EVENT_KINDS, RANK_AMAX_EVENT, parse_rank_amax
from fp8_protocol.codec import WireError, decode_float, encode_float
from monitor_server.detectors.types import StepBatch
from monitor_server.infra import body_json
from monitor_server.infra.wire import details_summary, json_too_deep
from monitor_server.services import commands as command_ops
from monitor_server.services.ingest_columns import StatsTable
from monitor_server.services.policies import check_actions
from monitor_server.storage.block_hist import HistEntry, hist_rows, update_histogram_sums
from monitor_server.storage.models import (
    Base,
    BlockHistogram,
    Command,
    EventRow,
    IngestBatch,
    Run,
    StepRow,
    StepStat,
    utcnow,
)
from monitor_server.storage.rollups import update_rollups
from monitor_server.storage.schemas import MAX_ID
from monitor_server.storage.stat_rows import step_stat_rows


def _table(model: type[Base]) -> Table:
    """A mapped class's table (inserted into with core statements: no ORM bookkeeping per row)."""
    return cast(Table, model.__table__)


_TOP_KEYS = {"idempotency_key", "steps", "events", "acks"}
_STEP_KEYS = {"step", "scalars", "stats", "block_hist"}


@dataclass
class DecodedBatch:
    """A validated telemetry batch. Steps ascending; `stats[name]` is (S, T) float64 for each base column
    and, when the batch's steps carried them, each quality and block column; `has_stats` (S,) is False for a
    step sent without statistics (no FP8 layer ran in it; its `stats` rows are NaN); `block_hist` holds the
    block scale exponent histograms by step number (only the steps that sent some). The amax is as it will
    be stored (`fp8_protocol.stats.stored_amax`: NaN for a tensor whose elements were all NaN)."""

    idempotency_key: str
    steps: np.ndarray
    scalars: list[dict[str, float]]
    stats: dict[str, np.ndarray]
    events: list[dict[str, Any]] = field(default_factory=list)
    acks: list[dict[str, Any]] = field(default_factory=list)
    has_stats: np.ndarray | None = None
    block_hist: dict[int, list[HistEntry]] = field(default_factory=dict)
    #: the scalars as columns, built once when decoding (outside every lock): name -> (S,) float64, NaN
    #: where a step lacks the name, and name -> (S,) bool, True where the step carried it
    scalar_columns: dict[str, np.ndarray] = field(default_factory=dict)
    scalar_present: dict[str, np.ndarray] = field(default_factory=dict)
    #: the quality columns' steps where some steps of the batch carried them and others did not (a sampling
    #: schedule): (S,) bool per column, True where the step carried it; None when every step with statistics
    #: carried the same columns. Rows are stored for those steps only.
    quality_present: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.scalar_columns and any(self.scalars):  # built by hand, not by `decode_batch`
            self.scalar_columns, self.scalar_present = scalar_columns(self.scalars)


@dataclass
class StoreResult:
    """What storing a batch did."""

    duplicate: bool
    new_steps: StepBatch
    commands: list[Command]  # every unacknowledged command, for the response
    changed_commands: list[Command]  # commands whose state this batch changed (delivered, acked)
    #: the client events as stored (with their `id`, `run_id` and `created_at`), in the batch's order
    events: list[dict[str, Any]] = field(default_factory=list)
    steps_stored: int = 0  # the run's stored steps, this batch's included


#: the largest step number accepted: 2^53 - 1, the largest integer a JavaScript number (the dashboard) and a
#: float64 hold exactly; a larger step would be shown and bucketed as a neighbouring one
MAX_STEP = 2**53 - 1


def _step(value: Any, where: str) -> int:
    step = _int(value, where)
    if step > MAX_STEP:
        raise WireError(f"{where}: {step} is above the largest step number, {MAX_STEP} (2^53 - 1)")
    return step


def _int(value: Any, where: str, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{where}: expected an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise WireError(f"{where}: must be >= {minimum}, got {value}")
    if value >= 2**62:
        raise WireError(f"{where}: too large")
    number: int = value
    return number


def parse_json(body: bytes | bytearray) -> Any:
    """Parse a request body (`monitor_server.infra.body_json`: a body of many values without holding the
    GIL throughout); malformed JSON raises WireError naming the position."""
    return body_json.parse(body)


@dataclass(frozen=True)
class EventLimits:
    """Bounds on the free-form part of a batch: each event's ``details`` and the scalars' names (the settings
    of the same names)."""

    max_json_depth: int = 32
    max_event_detail_bytes: int = 8 * 1024 * 1024
    max_scalar_names_per_batch: int = 1024
    max_scalar_name_chars: int = 200


def scalar_columns(
    scalars: list[dict[str, float]],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The steps' scalars as columns in one pass over the values: (name -> (S,) float64 with NaN where a
    step lacks the name, name -> (S,) bool where the step carried it), names sorted."""
    rows: dict[str, list[int]] = {}
    values: dict[str, list[float]] = {}
    for i, sc in enumerate(scalars):
        for name, value in sc.items():
            if name in rows:
                rows[name].append(i)
                values[name].append(value)
            else:
                rows[name], values[name] = [i], [value]
    S = len(scalars)
    columns, present = {}, {}
    for name in sorted(rows):
        col, where = np.full(S, np.nan), np.zeros(S, dtype=bool)
        col[rows[name]] = values[name]
        where[rows[name]] = True
        columns[name], present[name] = col, where
    return columns, present


def decode_batch(payload: Any, num_tensors: int, limits: EventLimits = EventLimits()) -> DecodedBatch:
    """Validate and decode a parsed telemetry body for a run with `num_tensors` tensors.

    Raises:
        WireError: with a message naming the offending field.
    """
    key, steps_in = _decode_envelope(payload)
    S = len(steps_in)
    steps = np.empty(S, dtype=np.int64)
    scalars: list[dict[str, float]] = []
    names: set[str] = set()  # the distinct scalar names so far
    table = StatsTable(S, num_tensors)
    for i, entry in enumerate(steps_in):
        where = f"steps[{i}]"
        if not isinstance(entry, dict):
            raise WireError(f"{where}: expected an object")
        extra = set(entry) - _STEP_KEYS
        if extra:
            raise WireError(f"{where}: unknown field(s) {sorted(extra)}")
        steps[i] = _step(entry.get("step"), f"{where}.step")
        sc = entry.get("scalars", {})
        if not isinstance(sc, dict):
            raise WireError(f"{where}.scalars: expected an object")
        scalars.append(_decode_scalars(sc, where, names, limits))
        table.add_step(i, int(steps[i]), entry, where)
    table.finish()
    order = _step_order(steps)
    if order is not None:
        steps = steps[order]
        scalars = [scalars[j] for j in order.tolist()]
        table.reorder(order)
    events = _decode_events(payload.get("events", []), num_tensors, limits)
    acks = _decode_acks(payload.get("acks", []))
    columns_of, present = scalar_columns(scalars)
    return DecodedBatch(
        key,
        steps,
        scalars,
        table.stats,
        events,
        acks,
        table.has_stats,
        table.block_hist,
        columns_of,
        present,
        table.quality_present(),
    )


def _decode_envelope(payload: Any) -> tuple[str, list[Any]]:
    """The body's idempotency key and its steps array, once the body is an object of the known fields."""
    if not isinstance(payload, dict):
        raise WireError("body: expected a JSON object")
    unknown = set(payload) - _TOP_KEYS
    if unknown:
        raise WireError(f"body: unknown field(s) {sorted(unknown)}; expected {sorted(_TOP_KEYS)}")
    key = payload.get("idempotency_key")
    if not isinstance(key, str) or not 1 <= len(key) <= 200 or "\x00" in key:
        raise WireError("idempotency_key: required, a string of 1..200 characters (no NUL)")
    steps_in = payload.get("steps", [])
    if not isinstance(steps_in, list):
        raise WireError("steps: expected an array")
    return key, steps_in


def _step_order(steps: np.ndarray) -> np.ndarray | None:
    """The permutation that puts the batch's steps in ascending order, None when they already are (a
    sender's usual batch: nothing to copy). A step number sent twice is refused."""
    S = len(steps)
    if S and len(np.unique(steps)) != S:
        raise WireError("steps: the same step number appears twice in one batch")
    order = np.argsort(steps, kind="stable")
    return order if S and np.any(order != np.arange(S)) else None


def _decode_scalars(sc: dict[str, Any], where: str, names: set[str], limits: EventLimits) -> dict[str, float]:
    """One step's scalars, their names bounded in length and (with `names`, the batch's so far) in number."""
    out = {}
    for k, v in sc.items():
        if len(k) > limits.max_scalar_name_chars:
            raise WireError(
                f"{where}.scalars: a name of {len(k)} characters exceeds the limit of"
                f" {limits.max_scalar_name_chars} (max_scalar_name_chars)"
            )
        if k not in names:
            names.add(k)
            if len(names) > limits.max_scalar_names_per_batch:
                raise WireError(
                    f"{where}.scalars: the batch names more than {limits.max_scalar_names_per_batch} distinct"
                    " scalars (max_scalar_names_per_batch)"
                )
        out[k] = decode_float(v, f"{where}.scalars.{k}")
    return out


def _decode_events(events: Any, num_tensors: int, limits: EventLimits) -> list[dict[str, Any]]:
    if not isinstance(events, list):
        raise WireError("events: expected an array")
    out = []
    for i, ev in enumerate(events):
        where = f"events[{i}]"
        if not isinstance(ev, dict) or set(ev) - EVENT_FIELDS:
            raise WireError(f"{where}: expected an object with kind, step and details")
        if ev.get("kind") not in EVENT_KINDS:
            raise WireError(f"{where}.kind: must be one of {list(EVENT_KINDS)}")
        details = ev.get("details", {})
        if not isinstance(details, dict):
            raise WireError(f"{where}.details: expected an object")
        size = check_free_json(
            details, f"{where}.details", limits.max_json_depth, limits.max_event_detail_bytes
        )
        if ev["kind"] == RANK_AMAX_EVENT:
            try:
                parse_rank_amax(details, num_tensors)
            except (ValueError, KeyError) as exc:
                raise WireError(f"{where}.details: {exc}") from None
        step = _step(ev.get("step"), f"{where}.step")
        summary = details_summary(details)
        out.append(
            {"kind": ev["kind"], "step": step, "details": details, "summary": summary, "details_bytes": size}
        )
    return out


def _decode_acks(acks: Any) -> list[dict[str, Any]]:
    if not isinstance(acks, list):
        raise WireError("acks: expected an array")
    out = []
    for i, ack in enumerate(acks):
        where = f"acks[{i}]"
        if not isinstance(ack, dict):
            raise WireError(f"{where}: expected an object")
        cid = _int(ack.get("command_id"), f"{where}.command_id", minimum=1)
        if cid > MAX_ID:
            raise WireError(f"{where}.command_id: no such command")
        state = ack.get("state")
        if state == "applied":
            if set(ack) - {"command_id", "state", "step"}:
                raise WireError(f"{where}: an 'applied' ack has command_id, state and step")
            out.append({"command_id": cid, "state": state, "step": _step(ack.get("step"), f"{where}.step")})
        elif state == "rejected":
            reason = ack.get("reason")
            if not isinstance(reason, str) or set(ack) - {"command_id", "state", "reason"}:
                raise WireError(f"{where}: a 'rejected' ack has command_id, state and reason (a string)")
            out.append({"command_id": cid, "state": state, "reason": reason[:2000].replace("\x00", "")})
        else:
            raise WireError(f"{where}.state: must be 'applied' or 'rejected'")
    return out


def check_free_json(value: Any, where: str, max_depth: int, max_bytes: int) -> int:
    """Refuse a free-form JSON object nested deeper than `max_depth` or larger than `max_bytes` as JSON:
    stored deeper, it could not be written back out (orjson stops at 254 levels) and would break every
    reader of the run; larger, it would be held whole by every list and stream that carries it."""
    if json_too_deep(value, max_depth):
        raise WireError(f"{where}: nested deeper than the limit of {max_depth} levels (max_json_depth)")
    try:
        size = len(orjson.dumps(value))
    except orjson.JSONEncodeError as exc:  # e.g. an integer beyond 64 bits
        raise WireError(f"{where}: not storable as JSON ({exc})") from None
    if size > max_bytes:
        raise WireError(
            f"{where}: {size} bytes of JSON exceed the limit of {max_bytes} bytes (max_event_detail_bytes)"
        )
    return size


class UnknownRun(LookupError):
    """The run does not exist."""


def store_batch(
    session: Session,
    run_id: int,
    batch: DecodedBatch,
    fp8_max: np.ndarray,
    max_scalar_names: int | None = None,
) -> StoreResult:
    """Store a decoded batch inside the caller's write transaction.

    Steps already stored for the run are skipped; client events are stored as sent; a repeated
    idempotency key stores nothing. Pending
    commands are returned and marked delivered.

    Args:
        max_scalar_names: the most distinct scalar names the run may have (``max_scalar_names_per_run``).

    Raises:
        UnknownRun: no such run.
        command_ops.CommandError: an ack names an unknown command.
        WireError: the batch would take the run past `max_scalar_names` (the caller rolls back).
    """
    run = session.execute(select(Run).where(Run.id == run_id).with_for_update()).scalar_one_or_none()
    if run is None:
        raise UnknownRun(run_id)
    if session.get(IngestBatch, (run_id, batch.idempotency_key)) is not None:
        commands, fresh = command_ops.deliver_pending(session, run)
        return StoreResult(True, StepBatch(steps=np.zeros(0, dtype=np.int64)), commands, fresh)
    new = _NewSteps.of(batch, _unstored(session, run, batch.steps))
    names = _grown_scalar_names(run, list(new.scalar_columns), max_scalar_names)
    now = utcnow()
    if len(new.steps):
        _store_steps(session, run, batch, new, fp8_max)
        _advance_run(run, new, names)
    events = _insert_events(session, run_id, now, batch.events)
    run.last_telemetry_at = now
    run.updated_at = now
    changed = command_ops.apply_acks(session, run, batch.acks)
    if run.last_step is not None:  # a remediation policy's commands, checked against the loss since
        check_actions(session, run=run, last_step=run.last_step, now=now)
    key = batch.idempotency_key
    session.add(IngestBatch(run_id=run_id, idempotency_key=key, stored_steps=len(new.steps)))
    commands, fresh = command_ops.deliver_pending(session, run)
    return StoreResult(False, new.step_batch(), commands, changed + fresh, events, run.steps_stored)


def _unstored(session: Session, run: Run, steps: np.ndarray) -> np.ndarray:
    """(S,) bool: the batch's steps the run has not stored yet. Only a batch that reaches back to the run's
    last stored step (one resent after a lost answer) costs a query."""
    keep = np.ones(len(steps), dtype=bool)
    if len(steps) and run.last_step is not None and steps[0] <= run.last_step:
        span = StepRow.step.between(int(steps[0]), int(steps[-1]))
        stored = set(session.scalars(select(StepRow.step).where(StepRow.run_id == run.id, span)))
        keep = np.fromiter((s not in stored for s in steps.tolist()), bool, len(steps))
    return keep


@dataclass
class _NewSteps:
    """The part of a batch the run has not stored yet (all of it but for a resent batch), each column cut
    to those steps; the scalars' columns keep only the names the new steps carry."""

    keep: np.ndarray  # (S,) bool over the batch's steps
    steps: np.ndarray
    stats: dict[str, np.ndarray]
    has_stats: np.ndarray
    scalars: list[dict[str, float]]
    scalar_columns: dict[str, np.ndarray]  # sorted by name
    scalar_present: dict[str, np.ndarray]

    @classmethod
    def of(cls, batch: DecodedBatch, keep: np.ndarray) -> _NewSteps:
        steps = batch.steps[keep]
        has_stats = batch.has_stats[keep] if batch.has_stats is not None else np.ones(len(steps), bool)
        scalars = [sc for sc, k in zip(batch.scalars, keep.tolist(), strict=True) if k]
        if keep.all():
            columns, present = batch.scalar_columns, batch.scalar_present
            return cls(keep, steps, batch.stats, has_stats, scalars, columns, present)
        stats = {name: m[keep] for name, m in batch.stats.items()}
        present = batch.scalar_present
        columns = {name: col[keep] for name, col in batch.scalar_columns.items() if present[name][keep].any()}
        present = {name: present[name][keep] for name in columns}
        return cls(keep, steps, stats, has_stats, scalars, columns, present)

    def step_batch(self) -> StepBatch:
        """The new steps as the detectors read them."""
        return StepBatch(
            steps=self.steps,
            scalars=self.scalar_columns,
            stats=self.stats,
            present=self.scalar_present,
            has_stats=None if self.has_stats.all() else self.has_stats,
        )


def _grown_scalar_names(run: Run, scalar_names: list[str], max_scalar_names: int | None) -> set[str] | None:
    """The run's scalar names with the batch's, when the batch brings new ones (None when it does not);
    refused when they would be more than `max_scalar_names`."""
    known = set(run.scalar_names or ())
    if known.issuperset(scalar_names):
        return None
    names = known.union(scalar_names)
    if max_scalar_names is not None and len(names) > max_scalar_names:
        raise WireError(
            f"steps: the run would have {len(names)} distinct scalar names, more than the limit of"
            f" {max_scalar_names} (max_scalar_names_per_run); it has {len(known)}"
        )
    return names


def _store_steps(
    session: Session, run: Run, batch: DecodedBatch, new: _NewSteps, fp8_max: np.ndarray
) -> None:
    """Insert the new steps' rows (steps, block histograms, statistics) and bring the rollups and the
    histograms' coarse sums up to the run's last step (blocks are written once the run is past them)."""
    run_id = run.id
    step_rows = []
    for s, sc in zip(new.steps.tolist(), new.scalars, strict=True):
        loss = sc.get("loss")
        finite_loss = loss if loss is not None and np.isfinite(loss) else None
        encoded = {k: encode_float(v) for k, v in sc.items()}
        step_rows.append({"run_id": run_id, "step": s, "loss": finite_loss, "scalars": encoded})
    session.execute(insert(_table(StepRow)), step_rows)
    if batch.block_hist:
        rows = hist_rows(run_id, batch.block_hist, new.steps)
        if rows:
            session.execute(insert(_table(BlockHistogram)), rows)
    stat_steps, with_stats = _store_stat_rows(session, run_id, new, batch.quality_present)
    last_before = run.last_step
    last = int(new.steps[-1])
    upto = max(last, last_before or last)
    update_rollups(session, run_id, stat_steps, with_stats, fp8_max, last_before, upto)
    update_histogram_sums(session, run_id, len(fp8_max), batch.block_hist, new.steps, last_before, upto)


def _store_stat_rows(
    session: Session, run_id: int, new: _NewSteps, quality_present: np.ndarray | None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Insert the statistics rows of the new steps that carried statistics (no placeholder rows for the
    others; the quality columns' rows only for the steps that carried them); those steps and their
    statistics, which the rollups take next."""
    stat_steps, with_stats = new.steps, new.stats
    if not new.has_stats.all():
        stat_steps = new.steps[new.has_stats]
        with_stats = {name: m[new.has_stats] for name, m in new.stats.items()}
    if len(stat_steps):
        quality = quality_present[new.keep][new.has_stats] if quality_present is not None else None
        rows = step_stat_rows(run_id, stat_steps, with_stats, quality_steps=quality)
        session.execute(insert(_table(StepStat)), rows)
    return stat_steps, with_stats


def _advance_run(run: Run, new: _NewSteps, names: set[str] | None) -> None:
    """The run's own record of its steps: first and last step (and the loss at the last), the count, its
    scalar names; a run the server closed as abandoned is running again, since its client is back."""
    last = int(new.steps[-1])
    if run.last_step is None or last >= run.last_step:
        run.last_step = last
        loss = new.scalars[-1].get("loss")
        if loss is not None:
            run.last_loss = encode_float(loss)
    first = int(new.steps[0])
    if run.first_step is None or first < run.first_step:
        run.first_step = first
    run.steps_stored += len(new.steps)
    if names is not None:
        run.scalar_names = sorted(names)
    if run.status == "crashed":
        run.status = "running"


def _insert_events(
    session: Session, run_id: int, now: datetime, events: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Store the client events and return them as stored, with their ids: the stream names each event as
    lists do (a big one is then fetched whole by its id)."""
    rows = [{"run_id": run_id, "created_at": now, **ev} for ev in events]
    if not rows:
        return rows
    table = _table(EventRow)
    ids = session.scalars(insert(table).returning(table.c.id, sort_by_parameter_order=True), rows)
    return [{**ev, "id": event_id} for ev, event_id in zip(rows, ids, strict=True)]
