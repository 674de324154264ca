"""Parsing is bounded by what it costs: a telemetry body's JSON values are counted before it is parsed (413
over the budget, gzip or not), free-form JSON (event details, run config and recipe) is refused when nested
deeper than the limit or, for event details, larger than the limit (422 naming it), and NaN / Infinity in a
run's config are refused rather than stored as null. Nothing of a refused request is stored."""

from __future__ import annotations

import gzip

import orjson
import pytest

from tests.support.server import API, create_run, run_body

JSON = {"Content-Type": "application/json"}


def nested(depth: int) -> dict:
    """An object nested `depth` levels deep (itself the first level)."""
    value: dict = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def nested_json(depth: int) -> bytes:
    """`nested(depth)` as JSON text, written directly (orjson writes at most 254 levels)."""
    return b'{"a":' * (depth - 1) + b'{"leaf":1}' + b"}" * (depth - 1)


def _post(client, rid: int, body: bytes, gz: bool = False):
    headers = {**JSON, "Content-Encoding": "gzip"} if gz else JSON
    return client.post(
        f"{API}/runs/{rid}/telemetry", content=gzip.compress(body) if gz else body, headers=headers
    )


def _nothing_stored(client, rid: int) -> None:
    run = client.get(f"{API}/runs/{rid}").json()
    assert run["steps_stored"] == 0 and run["last_telemetry_at"] is None
    assert client.get(f"{API}/runs/{rid}/events").json() == []


@pytest.mark.parametrize("gz", [False, True])
def test_json_value_budget(make_client, gz):
    """5,000 empty objects are a small body (10 kB, 60 bytes gzipped) but 5,000 values to build."""
    client = make_client(max_json_elements=1000)
    rid = create_run(client, 1)["id"]
    body = b'{"idempotency_key": "k", "events": [' + b",".join([b"{}"] * 5000) + b"]}"
    r = _post(client, rid, body, gz)
    assert r.status_code == 413, r.text
    assert "more JSON values than the parse budget of 1000 (max_json_elements)" in r.json()["detail"]
    _nothing_stored(client, rid)


@pytest.mark.parametrize("depth", [33, 254, 600, 1030])
def test_deep_event_details_refused_at_decode(client, depth):
    rid = create_run(client, 1)["id"]
    event = b'{"kind": "custom", "step": 1, "details": ' + nested_json(depth) + b"}"
    r = _post(client, rid, b'{"idempotency_key": "deep", "events": [' + event + b"]}")
    assert r.status_code == 422, r.text
    where = "body" if depth > 1000 else "events[0].details"  # beyond 1024 levels the parser itself stops
    assert r.json()["detail"] == f"{where}: nested deeper than the limit of 32 levels (max_json_depth)"
    _nothing_stored(client, rid)
    # at the limit it is stored, and reads back
    event = {"kind": "custom", "step": 1, "details": nested(32)}
    assert _post(client, rid, orjson.dumps({"idempotency_key": "ok", "events": [event]})).status_code == 200
    events = client.get(f"{API}/runs/{rid}/events").json()
    assert [e["details"] for e in events] == [nested(32)]


def test_event_detail_size_capped(make_client):
    client = make_client(max_event_detail_bytes=4096)
    rid = create_run(client, 1)["id"]
    event = {"kind": "custom", "step": 1, "details": {"blob": "x" * 5000}}
    r = _post(client, rid, orjson.dumps({"idempotency_key": "big", "events": [event]}))
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "events[0].details: 5011 bytes of JSON exceed the limit of 4096 bytes (max_event_detail_bytes)"
    )
    _nothing_stored(client, rid)


def test_run_config_depth_and_nonfinite(client):
    r = client.post(f"{API}/runs", json=run_body(1, config=nested(40)))
    assert r.status_code == 422
    assert r.json()["detail"] == "config: nested deeper than the limit of 32 levels (max_json_depth)"
    body = orjson.dumps(run_body(1)).replace(b'"lr":0.0003', b'"lr":NaN')
    assert b"NaN" in body
    r = client.post(f"{API}/runs", content=body, headers=JSON)
    assert r.status_code == 422 and r.json()["detail"].startswith("config.lr: NaN and Infinity are not JSON")
    body = orjson.dumps(run_body(1, recipe={"margin": [1, {"x": "inf"}]})).replace(b'"inf"', b"Infinity")
    r = client.post(f"{API}/runs", content=body, headers=JSON)
    assert r.status_code == 422 and r.json()["detail"].startswith("recipe.margin[1].x: NaN and Infinity")
    assert client.get(f"{API}/runs").json() == []
