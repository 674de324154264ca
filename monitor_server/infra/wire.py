"""The service's side of the wire (see docs/wire-format.md): checks on parsed JSON before it is decoded
(depth, non-finite tokens, the value budget), event summaries, and rendering answers (dates, float
matrices). The float and column codec both sides share is `fp8_protocol.codec`.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

import numpy as np
import orjson


def json_too_deep(value: Any, limit: int) -> bool:
    """Whether `value` (parsed JSON) nests objects and arrays more than `limit` levels deep; iterative, so a
    hostile document cannot exhaust the stack, and it stops at the first level past the limit."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def first_nonfinite(value: Any, where: str) -> str | None:
    """The path of the first NaN or infinite float inside parsed JSON (the tokens NaN / Infinity that
    Python's parser accepts but JSON does not), or None."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    return None


#: what an event summary keeps of each text value, how many fields it keeps, the longest key it keeps and
#: its size (keys and values as JSON, roughly: every list of events carries one per event)
SUMMARY_TEXT_CHARS = 200
SUMMARY_FIELDS = 32
SUMMARY_KEY_CHARS = 64
SUMMARY_BYTES = 2048


def details_summary(details: dict[str, Any]) -> dict[str, Any]:
    """The light form of event details: its top-level numbers, booleans, nulls and texts (the first
    `SUMMARY_TEXT_CHARS` characters), at most `SUMMARY_FIELDS` of them and about `SUMMARY_BYTES` in all;
    nested values, and keys longer than `SUMMARY_KEY_CHARS`, are left out. A summary is its own summary."""
    out: dict[str, Any] = {}
    size = 2
    for key, value in details.items():
        if len(out) >= SUMMARY_FIELDS:
            break
        if not isinstance(key, str) or len(key) > SUMMARY_KEY_CHARS:
            continue
        if value is None or isinstance(value, bool | int | float):
            kept = value
            cost = len(key) + 28  # quotes, colon, comma and the longest number
        elif isinstance(value, str):
            kept = value[:SUMMARY_TEXT_CHARS]
            cost = len(key) + len(kept.encode()) + 6
        else:
            continue
        if size + cost > SUMMARY_BYTES:
            break
        out[key] = kept
        size += cost
    return out


class JsonValueBudget:
    """An upper bound on the JSON values a body parses into, counted without parsing, piece by piece so a
    body far over the limit is refused after its first pieces: every value but the first follows a ','
    or opens an object or array (commas inside strings only raise the count). Parsing costs about this
    many Python objects; a packed base64 column is one value."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 1

    def over(self, piece: bytes | bytearray | memoryview) -> bool:
        """Count `piece`; True once the count is past the limit."""
        data = bytes(piece) if isinstance(piece, memoryview) else piece
        self.count += value_marks(data)
        return self.count > self.limit


def value_marks(data: bytes | bytearray) -> int:
    """The ',' and the '{' and '[' in `data`: each follows or opens a JSON value (`JsonValueBudget`)."""
    return data.count(b",") + data.count(b"{") + data.count(b"[")


def iso_dates(value: dict[str, Any]) -> dict[str, Any]:
    """A flat dict with datetime values as ISO-8601 strings (for SSE events and webhook payloads)."""
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in value.items()}


def dumps(value: Any) -> bytes:
    """orjson-encode an already `jsonable` value."""
    return orjson.dumps(value)


# Sentinels used to render a float matrix with orjson (which writes NaN/inf as null) and then spell the
# non-finite values as strings. They are the three largest float64 values, which no FP8 statistic reaches.
_SENT_NAN = np.finfo(np.float64).max
_SENT_POS = -np.finfo(np.float64).max
_SENT_NEG = np.nextafter(np.finfo(np.float64).max, 0.0)


def matrix_json(matrix: np.ndarray, empty_cols: np.ndarray | None = None) -> bytes:
    """JSON bytes of a 2-D float matrix (list of rows), non-finite spelled as strings, the columns flagged in
    `empty_cols` (a bool per column) null."""
    m = np.array(matrix, dtype=np.float64, order="C", copy=True)
    nan = np.isnan(m)
    if empty_cols is not None:
        nan[:, empty_cols] = False
    posinf = np.isposinf(m)
    neginf = np.isneginf(m)
    special = nan.any() or posinf.any() or neginf.any()
    if special:
        m[nan] = _SENT_NAN
        m[posinf] = _SENT_POS
        m[neginf] = _SENT_NEG
    if empty_cols is not None:
        m[:, empty_cols] = np.nan  # orjson writes null
    out = orjson.dumps(m, option=orjson.OPT_SERIALIZE_NUMPY)
    if special:
        # the negative sentinel first: its text contains the NaN sentinel's
        for sentinel, text in (
            (_SENT_POS, b'"Infinity"'),
            (_SENT_NAN, b'"NaN"'),
            (_SENT_NEG, b'"-Infinity"'),
        ):
            out = out.replace(orjson.dumps(float(sentinel)), text)
    return out
