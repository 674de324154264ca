"""The yielding body parser (`monitor_server.infra.body_json`) gives orjson's values and refuses what orjson
refuses, so a body's fate does not depend on how many values it holds."""

from __future__ import annotations

import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8_protocol.codec import WireError
from monitor_server.infra import body_json
from monitor_server.services.ingest import parse_json

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None)
@given(_values)
def test_the_yielding_parser_gives_orjsons_values(value):
    # integers past 64 bits are written by the standard library (orjson refuses to write them)
    text = orjson.dumps(value) if _fits(value) else _std_dumps(value)
    assert _same(body_json.parse_yielding(text), orjson.loads(text))


def _fits(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, list, dict)):
        return True
    if isinstance(value, int):
        return -(2**63) <= value < 2**64
    items = value.values() if isinstance(value, dict) else value
    return all(_fits(v) for v in items)


def _std_dumps(value: object) -> bytes:
    import json

    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "text",
    [
        b"[NaN]",
        b"[Infinity]",
        b'{"a": -Infinity}',
        b'["\\ud800"]',  # a lone high surrogate
        b'{"k": "\\udc00"}',  # a lone low surrogate
        b'["\\ud800x"]',
        b'["\\ud83d\\u0041"]',  # a high surrogate before a letter
        b"\xef\xbb\xbf{}",  # a byte order mark
        b'{"a": "\xff"}',  # not UTF-8
        b'{"a": 1} x',  # data after the value
        b'{"a": 1,}',
        b"[" * 2000 + b"]" * 2000,  # deeper than either parser goes
        b"",
    ],
)
def test_the_yielding_parser_refuses_what_orjson_refuses(text):
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(text)
    with pytest.raises(WireError, match="malformed JSON"):
        body_json.parse_yielding(text)


def test_a_surrogate_pair_and_an_escaped_backslash_are_kept():
    text = b'["\\ud83d\\ude00", "\\\\ud800", "\\\\\\ud83d\\ude00"]'
    assert body_json.parse_yielding(text) == orjson.loads(text) == ["\U0001f600", "\\ud800", "\\\U0001f600"]


def test_a_body_of_many_values_takes_the_yielding_parser_with_the_same_result(monkeypatch):
    """The telemetry route's parse: a batch of 300 x 1,000 scalars (the shape that held the GIL for the
    length of one orjson call) goes through the yielding parser and comes out as orjson reads it; a small
    body does not."""
    steps = [{"step": s, "scalars": {f"s{s}.n{j}": j / 7 for j in range(1000)}} for s in range(300)]
    body = orjson.dumps({"idempotency_key": "k", "steps": steps})
    assert body_json.value_bound(body) > body_json.YIELDING_VALUES
    taken: list[int] = []
    yielding = body_json.parse_yielding
    monkeypatch.setattr(body_json, "parse_yielding", lambda b: taken.append(len(b)) or yielding(b))
    assert parse_json(bytearray(body)) == orjson.loads(body)
    assert taken == [len(body)]
    small = orjson.dumps({"idempotency_key": "k", "steps": steps[:2]})
    assert parse_json(small) == orjson.loads(small) and taken == [len(body)]
    with pytest.raises(WireError, match="lone surrogate|surrogates not allowed"):
        parse_json(body[:-2] + b',"\\ud800"]}')
