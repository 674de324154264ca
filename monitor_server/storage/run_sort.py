"""The orders of the runs list (``GET /runs?sort=``) and the cursor of a sorted page.

A sort names a column the dashboard shows, ascending, or descending with a leading ``-``; the id breaks ties
in the same direction, so the order is total and a page continues after the last row of the previous one
(keyset paging: a run that changes meanwhile is never shown twice, nor one skipped that kept its place).
Column sorts are done by the database; ``config:KEY`` (a value of the run's JSON config) in Python, over at
most ``CONFIG_SORT_LIMIT`` runs.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Float, Text, and_, case, cast, func, or_, select

from monitor_server.storage.models import Incident, Run

#: the columns the runs list sorts by
SORTS = (
    "name",
    "status",
    "created",
    "duration",
    "last_step",
    "last_loss",
    "open_incidents",
    "last_telemetry",
)
CONFIG_PREFIX = "config:"
#: a config-value sort reads the config of at most this many runs (narrow the list with a filter beyond)
CONFIG_SORT_LIMIT = 20_000
#: where a run without a finite loss sorts: after every finite one, ascending
NO_LOSS = 1e308
_MAX_INT = 2**62
#: a config-value sort compares texts by this many characters at most
RANK_CHARS = 100
ALLOWED = (
    f"{', '.join(SORTS)} or {CONFIG_PREFIX}KEY (a config value; KEY may be a.b), "
    "with a leading - for descending"
)


@dataclass(frozen=True)
class RunSort:
    """A sort of the runs list: ``key`` is one of `SORTS` or ``config:KEY``."""

    key: str
    descending: bool = False

    @property
    def text(self) -> str:
        """The sort as the query spells it."""
        return ("-" if self.descending else "") + self.key

    @property
    def config_key(self) -> str | None:
        """The config key of a config-value sort, else None."""
        return self.key[len(CONFIG_PREFIX) :] if self.key.startswith(CONFIG_PREFIX) else None


def parse_sort(text: str | None) -> RunSort | None:
    """``"-last_loss"`` -> RunSort; None or "" -> None (newest first); ValueError saying what is allowed."""
    if not text:
        return None
    descending = text.startswith("-")
    key = text[1:] if descending else text
    if key in SORTS or (key.startswith(CONFIG_PREFIX) and len(key) > len(CONFIG_PREFIX)):
        return RunSort(key, descending)
    raise ValueError(f"sort: expected {ALLOWED}; got {text!r}")


def open_incidents_count() -> Any:
    """The number of open incidents of the run of the row (a correlated subquery)."""
    return (
        select(func.count())
        .where(Incident.run_id == Run.id, Incident.state == "open")
        .correlate(Run)
        .scalar_subquery()
    )


def _last_activity() -> ColumnElement:
    return func.coalesce(Run.last_telemetry_at, Run.created_at)


def _duration(dialect: str) -> ColumnElement:
    """Seconds from the run's registration to its last telemetry (0 before any)."""
    if dialect == "postgresql":
        return cast(func.extract("epoch", _last_activity() - Run.created_at), Float)
    # to the millisecond (SQLite's time resolution): the float error of a difference of Julian days would
    # otherwise tell equal durations apart
    days = func.julianday(_last_activity()) - func.julianday(Run.created_at)
    return func.round(days * 86_400_000.0) / 1000.0


def _last_loss(dialect: str) -> ColumnElement:
    """The last loss as a number; NaN, infinities and none at all as `NO_LOSS`."""
    if dialect == "postgresql":
        number = func.json_typeof(Run.last_loss) == "number"
        value = cast(cast(Run.last_loss, Text), Float)
    else:
        number = func.json_type(Run.last_loss).in_(("integer", "real"))
        value = cast(func.json_extract(Run.last_loss, "$"), Float)
    return case((number, value), else_=NO_LOSS)


def sort_expression(sort: RunSort, dialect: str) -> ColumnElement:
    """The SQL value a column sort orders by (`dialect`: sqlite or postgresql)."""
    return {
        "name": lambda: func.lower(Run.name),
        "status": lambda: Run.status,
        "created": lambda: Run.created_at,
        "duration": lambda: _duration(dialect),
        "last_step": lambda: func.coalesce(Run.last_step, -1),
        "last_loss": lambda: _last_loss(dialect),
        "open_incidents": open_incidents_count,
        "last_telemetry": _last_activity,
    }[sort.key]()


def order_by(sort: RunSort, expr: ColumnElement) -> tuple[Any, Any]:
    """ORDER BY the sort's value, then the id, both in the sort's direction."""
    if sort.descending:
        return expr.desc(), Run.id.desc()
    return expr.asc(), Run.id.asc()


def after(sort: RunSort, expr: ColumnElement, value: Any, run_id: int) -> ColumnElement:
    """The rows that come after (value, run_id) in the sort's order."""
    if sort.descending:
        return or_(expr < value, and_(expr == value, Run.id < run_id))
    return or_(expr > value, and_(expr == value, Run.id > run_id))


# ----- the cursor: the sort, and the last row's value and id, as url-safe base64 of JSON -----


def encode_cursor(sort: RunSort, value: Any, run_id: int) -> str:
    """The cursor continuing after the row (value, run_id) of a list in `sort`'s order."""
    if isinstance(value, datetime):
        value = value.isoformat()
    raw = json.dumps([sort.text, value, run_id], separators=(",", ":"), ensure_ascii=False)
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(sort: RunSort, cursor: str) -> tuple[Any, int]:
    """(value, run id) of a cursor `encode_cursor` made for `sort`; ValueError when it is not one."""
    bad = ValueError(f"cursor: not a cursor of the runs list sorted by {sort.text!r} (X-Next-Cursor)")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        text, value, run_id = json.loads(raw)
    except (ValueError, TypeError, binascii.Error):
        raise bad from None
    if text != sort.text or not _is_int(run_id, 1, 2**31 - 1):
        raise bad
    try:
        return _cursor_value(sort.key, value), run_id
    except (ValueError, TypeError):
        raise bad from None


def _is_int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _cursor_value(key: str, value: Any) -> Any:
    """The cursor's value as the sort's SQL value binds (ValueError: not of its type)."""
    if key.startswith(CONFIG_PREFIX):
        return config_rank_from_json(value)
    if key in ("name", "status"):
        if isinstance(value, str) and "\x00" not in value and len(value) <= 1000:
            return value
    elif key in ("created", "last_telemetry"):
        if isinstance(value, str) and len(value) <= 64:
            return datetime.fromisoformat(value)
    elif key in ("last_step", "open_incidents"):
        if _is_int(value, -_MAX_INT, _MAX_INT):
            return value
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= NO_LOSS:
        return float(value)  # duration, last_loss
    raise ValueError(key)


# ----- config-value sorts, in Python -----

#: what `config_value` gives for a key the config does not have
MISSING = object()


def config_value(config: Any, key: str) -> Any:
    """The value at ``a.b`` of a nested config, or `MISSING`."""
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def config_rank(value: Any) -> list[Any]:
    """A config value as a comparable, JSON-able key: numbers (and booleans) by value, then strings, then
    any other value by its JSON text (texts by their first `RANK_CHARS` characters, which keeps the cursor
    short); a run without the key after all of them."""
    if value is MISSING:
        return [3, ""]
    if isinstance(value, (bool, int, float)):
        return [0, float(value)]
    if isinstance(value, str):
        return [1, value[:RANK_CHARS]]
    return [2, json.dumps(value, sort_keys=True)[:RANK_CHARS]]


def config_rank_from_json(value: Any) -> list[Any]:
    """A `config_rank` read back from a cursor (ValueError when it is not one)."""
    ok = isinstance(value, list) and len(value) == 2 and value[0] in (0, 1, 2, 3)
    if ok and value[0] == 0:
        ok = isinstance(value[1], (int, float)) and not isinstance(value[1], bool)
    elif ok:
        ok = isinstance(value[1], str)
    if not ok:
        raise ValueError("config rank")
    return [value[0], float(value[1]) if value[0] == 0 else value[1]]


@functools.total_ordering
class _Reversed:
    """A key that orders the other way round."""

    def __init__(self, key: Any):
        self.key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Reversed) and self.key == other.key

    def __lt__(self, other: _Reversed) -> bool:
        return other.key < self.key


def config_order_key(sort: RunSort, rank: list[Any], run_id: int) -> tuple[Any, ...]:
    """The Python sort key of a run in a config-value sort: runs without the key last in both directions."""
    missing = rank[0] == 3
    inner = (tuple(rank), run_id)
    return (missing, _Reversed(inner) if sort.descending else inner)
