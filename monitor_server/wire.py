"""The wire encoding of floats and statistic columns (see docs/wire-format.md).

JSON cannot spell NaN or ±infinity, so every non-finite float crossing the API is the string "NaN",
"Infinity" or "-Infinity". A statistic column (COL) is either a JSON array of T numbers (non-finite values
as those strings) or a packed column ``{"dtype": "float32"|"float64", "b64": "<base64 little-endian>"}``.
"""

from __future__ import annotations

import base64
import binascii
import math
from datetime import datetime
from typing import Any

import numpy as np
import orjson

NONFINITE_STRINGS: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_PACKED_DTYPES = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}


class WireError(ValueError):
    """A request body that does not follow the wire format; the message names the problem."""


def decode_float(value: Any, where: str) -> float:
    """One wire float: a JSON number or one of the three non-finite strings."""
    if isinstance(value, bool):
        raise WireError(f"{where}: expected a number, got a boolean")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value in NONFINITE_STRINGS:
        return NONFINITE_STRINGS[value]
    raise WireError(f"{where}: expected a number or one of 'NaN', 'Infinity', '-Infinity', got {value!r:.40}")


def encode_float(x: float) -> float | str:
    """A float as JSON can carry it: finite unchanged, NaN / ±inf as "NaN" / "Infinity" / "-Infinity"."""
    x = float(x)
    if math.isfinite(x):
        return x
    if x != x:
        return "NaN"
    return "Infinity" if x > 0 else "-Infinity"


def jsonable(value: Any) -> Any:
    """`value` with every non-finite float (also inside dicts, lists and numpy arrays) spelled as a string."""
    if isinstance(value, float | np.floating):
        return encode_float(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        return [jsonable(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


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
        self.count += data.count(b",") + data.count(b"{") + data.count(b"[")
        return self.count > self.limit


def decode_column(value: Any, length: int, where: str) -> np.ndarray:
    """Decode one COL into a float64 array of `length` values.

    Raises:
        WireError: wrong length, wrong dtype, bad base64 or a non-number element.
    """
    if isinstance(value, dict):
        dtype = _PACKED_DTYPES.get(value.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise WireError(
                f"{where}: packed column dtype must be 'float32' or 'float64', got {value.get('dtype')!r}"
            )
        b64 = value.get("b64")
        if not isinstance(b64, str) or set(value) != {"dtype", "b64"}:
            raise WireError(f"{where}: packed column must be exactly {{'dtype': ..., 'b64': '<base64>'}}")
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise WireError(f"{where}: invalid base64 ({exc})") from None
        if len(raw) != length * dtype.itemsize:
            held = len(raw) / dtype.itemsize
            raise WireError(
                f"{where}: packed column holds {held:g} {dtype.name} values, "
                f"expected {length} (one per tensor)"
            )
        return np.frombuffer(raw, dtype=dtype).astype(np.float64)
    if isinstance(value, list):
        if len(value) != length:
            raise WireError(f"{where}: column has {len(value)} values, expected {length} (one per tensor)")
        arr = np.array(value) if value else np.zeros(0)
        if arr.dtype.kind in "fi" and arr.ndim == 1 and not any(v is True or v is False for v in value):
            return arr.astype(np.float64, copy=False)
        # mixed numbers and non-finite strings (or garbage): the careful path
        return np.array([decode_float(v, f"{where}[{i}]") for i, v in enumerate(value)], dtype=np.float64)
    raise WireError(f"{where}: expected a JSON array or a packed column object, got {type(value).__name__}")


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
